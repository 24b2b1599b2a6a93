"""diffusers attention processors whose Ulysses send side is attnprep's: the projections' q, k and v go to
:func:`attnprep.ulysses.ulysses_attention` with the model's QK norm and RoPE as its ``prologue`` (one pass to the
send buffer where the fused kernel takes the arguments), in place of the model's norm, its RoPE and the exchange.

Wan 2.x (its self-attention: the RMSNorm over all heads of a token, per-token cos/sin), Flux (single-stream blocks:
per-head RMSNorm; double-stream blocks: text and image rows with their own norms, joined as the model joins them)
and Qwen-Image (joint text + image rows, their own norms, complex per-token frequencies, the text-padding mask as
the layer's key mask). Every other call (cross-attention, other masks, CPU tensors, no Ulysses group) runs the
model's own processor unchanged. Imports diffusers; relies on ``transformer_wan._get_qkv_projections``,
``transformer_flux._get_qkv_projections``, the Qwen-Image attention's projection and norm attributes, the
processors' ``_parallel_config`` and ``ContextParallelConfig``'s ``_ulysses_mesh``.
"""

from __future__ import annotations

from typing import Optional

import torch
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm
from diffusers.models.transformers import transformer_flux as flux
from diffusers.models.transformers import transformer_qwenimage as qwen
from diffusers.models.transformers import transformer_wan as wan

from ..rope_tables import rope_cos_sin_rows
from ..ulysses import sdpa_batched, ulysses_attention

Tensor = torch.Tensor

# The last rotary embedding's rows: every block of one forward passes the same tensors.
_ROWS: list = [(), None]


def _rows(first: Tensor, second: Tensor) -> Tensor:
    """``[S, D]`` float32 rows of diffusers' real cos and sin (adjacent pairs, any leading dimensions of one), or of
    two complex frequency tables ``[rows, D / 2]`` whose rows follow one another (Qwen-Image's text, then image)."""
    if len(_ROWS[0]) != 2 or _ROWS[0][0] is not first or _ROWS[0][1] is not second:
        if first.is_complex():
            rows = torch.cat([rope_cos_sin_rows(t, check=False) for t in (first, second)])
        else:
            rows = rope_cos_sin_rows(*(t.reshape(-1, t.shape[-1]) for t in (first, second)), check=False)
        _ROWS[:] = [(first, second), rows]
    return _ROWS[1]


def _norm(norm, x: Tensor) -> Optional[tuple]:
    """(weight, eps) of an RMSNorm with a weight (torch's, or diffusers' without a bias), or None."""
    if isinstance(norm, torch.nn.RMSNorm) and norm.weight is not None:
        return norm.weight, torch.finfo(x.dtype).eps if norm.eps is None else norm.eps
    if isinstance(norm, DiffusersRMSNorm) and norm.weight is not None and getattr(norm, "bias", None) is None:
        return norm.weight, norm.eps
    return None


def _prologue(attn, x: Tensor, rows: Tensor, text_rows: int = 0) -> Optional[dict]:
    """The module's QK norm (with ``text_rows``, its text norms for the first rows) and RoPE as the layer's
    prologue; None where a norm is not an RMSNorm with a weight or the eps differ (the model's processor runs)."""
    norms = [_norm(attn.norm_q, x), _norm(attn.norm_k, x)]
    if text_rows:
        norms += [_norm(attn.norm_added_q, x), _norm(attn.norm_added_k, x)]
    if any(n is None for n in norms) or len({n[1] for n in norms}) != 1:
        return None
    prologue = dict(cos_sin_cache=rows, is_neox=False, q_norm_weight=norms[0][0], k_norm_weight=norms[1][0])
    prologue["norm_eps"] = norms[0][1]
    if text_rows:
        prologue["text_norm"] = (text_rows, norms[2][0], norms[3][0])
    return prologue


def _attend(q: Tensor, k: Tensor, v: Tensor, group, prologue: dict, options: dict, mask=None) -> Tensor:
    return ulysses_attention(
        q, k, v, group=group, attn_fn=sdpa_batched(), prologue=prologue, key_padding_mask=mask, **options
    )


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
            prologue = _prologue(attn, hidden_states, _rows(*rotary_emb))
            if prologue is not None:
                query, key, value = wan._get_qkv_projections(attn, hidden_states, None)
                q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
                out = _attend(q, k, v, group, prologue, self.attnprep_options)
                return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(query)))
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)


class FluxSendProcessor(_SendSide, flux.FluxAttnProcessor):
    """Flux's processor with attnprep's send side: single-stream blocks, and double-stream blocks (text rows
    first, with the module's added norms, as the model joins them)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        group = self._taken(hidden_states, attention_mask, image_rotary_emb)
        joint = encoder_hidden_states is not None
        if group is not None and isinstance(image_rotary_emb, tuple) and joint == (attn.added_kv_proj_dim is not None):
            text = encoder_hidden_states.shape[1] if joint else 0
            prologue = _prologue(attn, hidden_states, _rows(*image_rotary_emb), text)
            if prologue is not None:
                query, key, value, *added = flux._get_qkv_projections(attn, hidden_states, encoder_hidden_states)
                heads = [t.unflatten(-1, (-1, attn.head_dim)) for t in (query, key, value)]
                if joint:
                    heads = [torch.cat([a.unflatten(-1, (-1, attn.head_dim)), x], dim=1) for a, x in zip(added, heads)]
                out = _attend(*heads, group, prologue, self.attnprep_options).flatten(2, 3).to(query.dtype)
                if not joint:
                    return out
                context, out = out.split_with_sizes([text, out.shape[1] - text], dim=1)
                out = attn.to_out[1](attn.to_out[0](out.contiguous()))
                return out, attn.to_add_out(context.contiguous())
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


class QwenSendProcessor(_SendSide, qwen.QwenDoubleStreamAttnProcessor2_0):
    """Qwen-Image's joint processor with attnprep's send side: text rows first with the module's added norms, the
    text and image frequencies as one table, the text-padding mask as the layer's key mask."""

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        encoder_hidden_states_mask=None,
        attention_mask=None,
        image_rotary_emb=None,
    ):
        group = self._taken(hidden_states, attention_mask, image_rotary_emb)
        if group is not None and encoder_hidden_states is not None and isinstance(image_rotary_emb, tuple):
            text = encoder_hidden_states.shape[1]
            image_freqs, text_freqs = image_rotary_emb
            prologue = _prologue(attn, hidden_states, _rows(text_freqs, image_freqs), text)
            if prologue is not None:
                head_dim = attn.inner_dim // attn.heads
                pairs = ((attn.add_q_proj, attn.to_q), (attn.add_k_proj, attn.to_k), (attn.add_v_proj, attn.to_v))
                projections = [
                    torch.cat([added(encoder_hidden_states), own(hidden_states)], dim=1).unflatten(-1, (-1, head_dim))
                    for added, own in pairs
                ]
                mask = None
                if encoder_hidden_states_mask is not None:
                    image = torch.ones_like(hidden_states[..., 0], dtype=torch.bool)
                    mask = torch.cat([encoder_hidden_states_mask.to(torch.bool), image], dim=1)
                out = _attend(*projections, group, prologue, self.attnprep_options, mask)
                out = out.flatten(2, 3).to(projections[0].dtype)
                context, out = out[:, :text], out[:, text:]
                out = attn.to_out[0](out.contiguous())
                if len(attn.to_out) > 1:
                    out = attn.to_out[1](out)
                return out, attn.to_add_out(context.contiguous())
        return super().__call__(
            attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, attention_mask, image_rotary_emb
        )


PROCESSORS = {
    wan.WanAttnProcessor: WanSendProcessor,
    flux.FluxAttnProcessor: FluxSendProcessor,
    qwen.QwenDoubleStreamAttnProcessor2_0: QwenSendProcessor,
}


def install(model: torch.nn.Module, group=None, options: Optional[dict] = None) -> int:
    """Each attention module of ``model`` whose processor is exactly Wan's, Flux's or Qwen-Image's gets attnprep's (its
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
