"""qk_norm_rope: the QK norm and RoPE of q and k with no KV cache (diffusion transformers, encoders, the Ulysses
send side): rope_pool_fused's kernel without the cache write, after a per-token norm's own kernel where the norm
spans all of a token's heads."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from . import _C, _ops
from ._dispatch import direct, tensor_arg
from .rope_pool import rope_pool_fused

Tensor = torch.Tensor


def _tokens(x: Tensor) -> Optional[Tensor]:
    """``[B, S, ...]`` as ``[B * S, ...]`` when a view can be (its batch stride S times its token stride), else None."""
    if x.dim() < 2 or x.shape[0] == 1 or x.stride(0) == x.shape[1] * x.stride(1):
        return x.flatten(0, 1)
    return None


def _per_token(weight, x: Tensor) -> bool:
    """A norm weight of heads * head_dim (more than one head): the norm over all of a token's heads (Wan)."""
    return (
        isinstance(weight, Tensor)
        and weight.dim() == 1
        and x.shape[-2] > 1
        and weight.shape[0] == x.shape[-2] * x.shape[-1]
    )


def _rotate(q: Tensor, k: Tensor, positions, inplace: bool, kw: dict) -> Tuple[Tensor, Tensor]:
    """[T, H, D] q and k through rope_pool_fused without a cache; a per-token norm runs first, into the outputs
    (after every check of both steps: nothing is written on an error), and the rotation then in place (out of
    place into a new fp8 q_rot with ``q_scale``)."""
    per_q, per_k = _per_token(kw["q_norm_weight"], q), _per_token(kw["k_norm_weight"], k)
    if not (per_q or per_k):
        q_rot, k_rot, _, _ = rope_pool_fused(q, k, None, positions, None, None, None, inplace=inplace, **kw)
        return q_rot, k_rot
    head_kw = dict(kw)
    if per_q:
        head_kw["q_norm_weight"] = None
    if per_k:
        head_kw["k_norm_weight"] = None
    eps, offset = kw["norm_eps"], kw["norm_weight_offset"]
    rope_inplace = inplace or kw["q_scale"] is None
    if not torch.compiler.is_compiling():  # a traced call meets the same checks in the ops' fake kernels
        metadata_only = not direct(q, k)
        args = _ops.RopeArgs(
            q, k, None, positions, None, None, None, k_scale=None, v_scale=None, kv_layout="NHD", **head_kw
        )
        _C.rope_pool_check(*args.for_extension(rope_inplace), metadata_only=metadata_only)
        for per, x, w in ((per_q, q, kw["q_norm_weight"]), (per_k, k, kw["k_norm_weight"])):
            if per:
                _C._qk_token_rms_norm(x, w, eps, offset, x, metadata_only=True)
    outs = []
    for per, x, w in ((per_q, q, kw["q_norm_weight"]), (per_k, k, kw["k_norm_weight"])):
        out = x if inplace or not (per or rope_inplace) else torch.empty_like(x)
        if per:
            torch.ops.attnprep._qk_token_rms_norm(x, w, eps, offset, out)
        elif out is not x:  # rotated in place below, with its per-head norm
            out.copy_(x)
        outs.append(out)
    q_rot, k_rot, _, _ = rope_pool_fused(
        outs[0], outs[1], None, positions, None, None, None, inplace=rope_inplace, **head_kw
    )
    return q_rot, k_rot


def qk_norm_rope(
    q: Tensor,
    k: Tensor,
    positions: Optional[Tensor] = None,
    *,
    cos_sin_cache: Optional[Tensor] = None,
    rope_base: float = 10000.0,
    rotary_dim: Optional[int] = None,
    is_neox: bool = True,
    q_norm_weight: Optional[Tensor] = None,
    k_norm_weight: Optional[Tensor] = None,
    norm_eps: float = 1e-6,
    norm_weight_offset: float = 0.0,
    inplace: bool = False,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
    q_scale: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """RoPE on q and k after an optional RMSNorm, with no KV cache: :func:`rope_pool_fused` without
    ``v``, slots or pools, for ``[T, heads, head_dim]`` or batched ``[B, S, heads, head_dim]`` tensors.

    Parameters
    ----------
    q, k : torch.Tensor
        ``[T, heads, head_dim]`` or ``[B, S, heads, head_dim]`` (the same leading dimensions, their own head
        counts), any strides but a unit last one: slices of one fused projection work as they are.
    positions : torch.Tensor, optional
        ``[T]`` or ``[B, S]`` (``[3, T]`` or ``[3, B, S]`` with ``mrope_section``), int32 or int64. None:
        per-token cos/sin, ``cos_sin_cache`` holding a row per token (``T`` or ``B * S`` rows), or ``S`` rows
        that every batch item shares (a diffusion transformer's frequencies, e.g. from
        :func:`rope_cos_sin_rows`).
    cos_sin_cache, rope_base, rotary_dim, is_neox : optional
        The rotation, as :func:`rope_pool_fused` takes it.
    q_norm_weight, k_norm_weight, norm_eps, norm_weight_offset : optional
        The QK norm, as :func:`rope_pool_fused` takes it, per head (a weight of ``[head_dim]``, fused), or one RMS
        over all of a token's heads (a weight of ``[heads * head_dim]``, Wan's form; CUDA or MPS; a kernel of its
        own before the rotation).
    mrope_section, mrope_interleaved : optional
        M-RoPE, as :func:`rope_pool_fused` takes it.
    q_scale : torch.Tensor, optional
        fp8 q, as :func:`rope_pool_fused` takes it: q_rot is float8_e4m3fn (CUDA, not in place).
    inplace : bool
        Write the results into ``q`` and ``k``.

    Returns
    -------
    tuple of torch.Tensor
        ``(q_rot, k_rot)`` in q's and k's shapes (``q`` and ``k`` themselves with ``inplace``).

    Raises
    ------
    ValueError
        ``qk_norm_rope: ...`` for shapes that do not fit together (contract.md), then the messages of
        :func:`rope_pool_fused` for the tensors as it receives them (``[B * S, heads, head_dim]``).

    Examples
    --------
    >>> B, S, H, D = 2, 77, 4, 128
    >>> qkv = torch.randn(B, S, 3 * H * D, device="cuda", dtype=torch.bfloat16)
    >>> q, k, _ = (t.unflatten(-1, (H, D)) for t in qkv.split(H * D, dim=-1))
    >>> angle = torch.arange(S, device="cuda")[:, None] * 1e4 ** -torch.linspace(0, 1, D // 2, device="cuda")
    >>> rows = torch.cat([angle.cos(), angle.sin()], dim=1)  # a row per token, shared by the batch
    >>> w = torch.ones(D, device="cuda")
    >>> q_rot, k_rot = qk_norm_rope(q, k, cos_sin_cache=rows, q_norm_weight=w, k_norm_weight=w)
    >>> q_rot.shape
    torch.Size([2, 77, 4, 128])
    """
    q, k = tensor_arg(q, "q"), tensor_arg(k, "k")
    mrope = mrope_section is not None
    if not torch.compiler.is_compiling():  # (a traced call meets the ops' checks in their fake kernels)
        _C._check_qk_norm_rope(q, k, tensor_arg(positions, "positions", optional=True), mrope)
    lead = q.shape[: q.dim() - 2]
    kw = dict(
        head_dim=q.shape[-1],
        num_qo_heads=q.shape[-2],
        num_kv_heads=k.shape[-2],
        rope_base=rope_base,
        rotary_dim=rotary_dim,
        is_neox=is_neox,
        cos_sin_cache=cos_sin_cache,
        q_norm_weight=q_norm_weight,
        k_norm_weight=k_norm_weight,
        norm_eps=norm_eps,
        norm_weight_offset=norm_weight_offset,
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
        q_scale=q_scale,
    )
    if q.dim() == 3:
        return _rotate(q, k, positions, inplace, kw)
    B, S = lead
    rows_shared = positions is None and isinstance(cos_sin_cache, Tensor) and B > 1 and cos_sin_cache.shape[0] == S
    if rows_shared:  # every batch item reads rows 0 ... S - 1
        positions = torch.arange(S, device=q.device, dtype=torch.int32).repeat(B)
    elif positions is not None:
        positions = positions.flatten(-2, -1)
    qt, kt = _tokens(q), _tokens(k)
    if qt is not None and kt is not None:
        q_rot, k_rot = _rotate(qt, kt, positions, inplace, kw)
        return (q, k) if inplace else (q_rot.view(q.shape), k_rot.view(k.shape))
    # a layout whose batch and tokens do not flatten (e.g. [B, heads, S, D] seen as [B, S, heads, D]): a launch
    # per batch item
    outs = []
    for b in range(B):
        at = None if positions is None else positions[..., b * S : (b + 1) * S]
        table = cos_sin_cache
        if positions is None and cos_sin_cache is not None and cos_sin_cache.shape[0] == B * S:
            table = cos_sin_cache[b * S : (b + 1) * S]
        outs.append(_rotate(q[b], k[b], at, inplace, dict(kw, cos_sin_cache=table)))
    if inplace:
        return q, k
    return _stack([o[0] for o in outs]), _stack([o[1] for o in outs])


def _stack(parts) -> Tensor:
    """torch.stack, also of float8 tensors (stacked as their bytes)."""
    if parts[0].dtype != torch.float8_e4m3fn:
        return torch.stack(parts)
    return torch.stack([p.view(torch.uint8) for p in parts]).view(torch.float8_e4m3fn)
