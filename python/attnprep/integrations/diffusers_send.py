"""diffusers attention processors whose Ulysses send side is attnprep's: the projections' q, k and v go to
:func:`attnprep.ulysses.ulysses_attention` with the model's QK norm and RoPE as its ``prologue`` (one qk_norm_rope
pass, then the layer's pack), in place of the model's norm, its RoPE and the exchange.

Wan 2.x (its self-attention: the RMSNorm over all heads of a token, per-token cos/sin) and Flux's single-stream
blocks (per-head RMSNorm, per-token cos/sin of the joint sequence). Every other call (cross-attention, Flux's
double-stream blocks, a mask, CPU tensors, no Ulysses group) runs the model's own processor unchanged. Imports
diffusers; relies on ``transformer_wan._get_qkv_projections``, ``transformer_flux._get_qkv_projections``, the
processors' ``_parallel_config`` and ``ContextParallelConfig``'s ``_ulysses_mesh``.
"""

from __future__ import annotations

from typing import Optional

import torch
from diffusers.models.transformers import transformer_flux as flux
from diffusers.models.transformers import transformer_wan as wan

from ..rope_tables import rope_cos_sin_rows
from ..ulysses import sdpa_batched, ulysses_attention

Tensor = torch.Tensor

# The last rotary embedding's rows: every block of one forward passes the same tensors.
_ROWS: list = [None, None, None]


def _rows(cos: Tensor, sin: Tensor) -> Tensor:
    """diffusers' real cos/sin (adjacent pairs, any leading dimensions of one) as ``[S, D]`` float32 rows."""
    if _ROWS[0] is not cos or _ROWS[1] is not sin:
        flat = (t.reshape(-1, t.shape[-1]) for t in (cos, sin))
        _ROWS[:] = [cos, sin, rope_cos_sin_rows(*flat, check=False)]
    return _ROWS[2]


def _norm(norm, x: Tensor) -> Optional[tuple]:
    """(weight, eps) of a torch RMSNorm with a weight, or None."""
    if not isinstance(norm, torch.nn.RMSNorm) or norm.weight is None:
        return None
    return norm.weight, torch.finfo(x.dtype).eps if norm.eps is None else norm.eps


def _attend(q: Tensor, k: Tensor, v: Tensor, group, attn, rows: Tensor, options: dict) -> Optional[Tensor]:
    """The layer with the module's norm and RoPE as its prologue; None where the module's norms are not RMSNorms
    with weights (the model's processor runs)."""
    nq, nk = _norm(attn.norm_q, q), _norm(attn.norm_k, k)
    if nq is None or nk is None or nq[1] != nk[1]:
        return None
    prologue = dict(cos_sin_cache=rows, is_neox=False, q_norm_weight=nq[0], k_norm_weight=nk[0], norm_eps=nq[1])
    return ulysses_attention(q, k, v, group=group, attn_fn=sdpa_batched(), prologue=prologue, **options)


class _SendSide:
    """A processor's Ulysses group (``attnprep_group``, else diffusers' ulysses mesh under its context parallelism
    with ring degree 1) and which calls attnprep takes."""

    def __init__(self, group=None, options: Optional[dict] = None):
        super().__init__()
        self.attnprep_group, self.attnprep_options = group, dict(options or {})

    def _taken(self, hidden_states: Tensor, attention_mask, rotary) -> Optional[object]:
        """The group for a call attnprep takes (CUDA, no mask, a rotary embedding), else None."""
        if attention_mask is not None or rotary is None or not hidden_states.is_cuda:
            return None
        if self.attnprep_group is not None:
            return self.attnprep_group
        config = getattr(self._parallel_config, "context_parallel_config", None)
        if config is None or config.ulysses_degree <= 1 or config.ring_degree != 1:
            return None
        return config._ulysses_mesh.get_group()


class WanSendProcessor(_SendSide, wan.WanAttnProcessor):
    """Wan's processor with attnprep's send side for its self-attention."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        group = self._taken(hidden_states, attention_mask, rotary_emb)
        if group is not None and encoder_hidden_states is None and attn.add_k_proj is None:
            query, key, value = wan._get_qkv_projections(attn, hidden_states, None)
            q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
            out = _attend(q, k, v, group, attn, _rows(*rotary_emb), self.attnprep_options)
            if out is not None:
                return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(query)))
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)


class FluxSendProcessor(_SendSide, flux.FluxAttnProcessor):
    """Flux's processor with attnprep's send side for its single-stream blocks."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        group = self._taken(hidden_states, attention_mask, image_rotary_emb)
        if group is not None and encoder_hidden_states is None and isinstance(image_rotary_emb, tuple):
            query, key, value, *_ = flux._get_qkv_projections(attn, hidden_states, None)
            q, k, v = (t.unflatten(-1, (-1, attn.head_dim)) for t in (query, key, value))
            out = _attend(q, k, v, group, attn, _rows(*image_rotary_emb), self.attnprep_options)
            if out is not None:
                return out.flatten(2, 3).to(query.dtype)
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


PROCESSORS = {wan.WanAttnProcessor: WanSendProcessor, flux.FluxAttnProcessor: FluxSendProcessor}


def install(model: torch.nn.Module, group=None, options: Optional[dict] = None) -> int:
    """Each attention module of ``model`` whose processor is exactly Wan's or Flux's gets attnprep's (its
    backend and parallel config kept); returns how many."""
    count = 0
    for module in model.modules():
        processor = getattr(module, "processor", None)
        cls = PROCESSORS.get(type(processor))
        if cls is None:
            continue
        fused = cls(group, options)
        fused._attention_backend, fused._parallel_config = processor._attention_backend, processor._parallel_config
        module.set_processor(fused)
        count += 1
    return count
