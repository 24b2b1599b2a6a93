"""Plain-torch references of every op: the oracles of the tests, the
benchmarks, the self-check of ``python -m attnprep`` and the sanitizer run.

Written for clarity, not speed, and independent of the library's own code
paths (the Ulysses layer's plain-torch packing included): a test compares the
library against these, never against itself. The rope reference computes in
float64 from the float32 angle the contract specifies (docs/contract.md).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

Tensor = torch.Tensor


def pack_reference(q: Tensor, k: Tensor, v: Tensor, world_size: int) -> Tensor:
    """``out[d, r, h] = q | k | v [r, d * local + h]``, as a new contiguous tensor."""
    rows, heads, dim = q.shape
    local = heads // world_size
    out = torch.empty((world_size, rows, local, 3 * dim), dtype=q.dtype, device=q.device)
    for d in range(world_size):
        for j, t in enumerate((q, k, v)):
            out[d, :, :, j * dim : (j + 1) * dim] = t[:, d * local : (d + 1) * local]
    return out


def pack_gqa_reference(q: Tensor, k: Tensor, v: Tensor, world_size: int) -> Tensor:
    """The Ulysses layer's grouped-query send buffer ``[W, rows, (local_q + 2 local_kv) * D]``:
    for destination d its q heads, then its kv heads (split when kv_heads >= W,
    else the one kv head its q heads use), then the same v heads."""
    rows, heads, dim = q.shape
    kv = k.shape[1]
    local_q = heads // world_size
    parts = []
    for d in range(world_size):
        qs = q[:, d * local_q : (d + 1) * local_q]
        if kv >= world_size:
            n = kv // world_size
            ks, vs = k[:, d * n : (d + 1) * n], v[:, d * n : (d + 1) * n]
        else:
            head = (d * local_q) // (heads // kv)  # the kv head of this destination's first q head
            ks, vs = k[:, head : head + 1], v[:, head : head + 1]
        parts.append(torch.cat([qs, ks, vs], dim=1).reshape(rows, (qs.shape[1] + 2 * ks.shape[1]) * dim))
    return torch.stack(parts).contiguous()


def attention_reference(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """Attention over a whole sequence, ``[S, h, D]`` each (k/v heads repeated
    to q's for grouped-query attention), through torch's SDPA: what the
    Ulysses layer must reproduce across ranks."""
    import torch.nn.functional as F

    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=causal
    )
    return out[0].transpose(0, 1)


def merge_reference(x: Tensor) -> Tensor:
    """``[W, S, B, h, D] -> [B, S, W, h, D]``."""
    return x.permute(2, 1, 0, 3, 4).contiguous()


def inv_freq(base: float, rotary_dim: int) -> Tensor:
    """float32(1 / base^(2i / rotary_dim)), computed in double and rounded once."""
    i = torch.arange(rotary_dim // 2, dtype=torch.float64)
    return (1.0 / base ** (2 * i / rotary_dim)).to(torch.float32)


def cos_sin(
    positions: Tensor, rotary_dim: int, base: Optional[float] = None, cos_sin_cache: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor]:
    """(cos, sin) ``[T, rotary_dim / 2]`` in float64: of the float32 angle, or the table's values exactly."""
    if cos_sin_cache is not None:
        rows = cos_sin_cache.cpu()[positions.long().cpu()].double()
        return rows[:, : rotary_dim // 2], rows[:, rotary_dim // 2 :]
    angle = positions.cpu().to(torch.float32)[:, None] * inv_freq(base, rotary_dim)[None, :]  # float32 product
    return torch.cos(angle.double()), torch.sin(angle.double())


def mrope_axes(half: int, mrope_section, interleaved: bool) -> Tensor:
    """M-RoPE: the position axis (0 time, 1 height, 2 width) that rotates each of
    the ``half`` frequencies. Contiguous sections (Qwen2-VL, Qwen2.5-VL):
    section j covers the next ``mrope_section[j]`` frequencies with axis j;
    interleaved (Qwen3-VL): frequency i takes height where i % 3 == 1 and
    width where i % 3 == 2, within 3 * that section's size, time elsewhere."""
    if sum(mrope_section) != half:
        raise ValueError(f"mrope_section must sum to rotary_dim / 2 = {half}, got {list(mrope_section)}")
    i = torch.arange(half)
    if not interleaved:
        return torch.repeat_interleave(torch.arange(len(mrope_section)) % 3, torch.tensor(list(mrope_section)))
    axes = torch.zeros(half, dtype=torch.int64)
    for axis in (1, 2):
        axes[(i % 3 == axis) & (i < 3 * mrope_section[axis])] = axis
    return axes


def mrope_cos_sin_rows(cos_sin_cache: Tensor, positions: Tensor, mrope_section, interleaved: bool = False) -> Tensor:
    """The per-token cos/sin rows ``[T, rotary_dim]`` of M-RoPE from a table
    ``[max_position, rotary_dim]`` and positions ``[3, T]`` (time, height,
    width): frequency i of token t from row ``positions[axis(i), t]``
    (:func:`mrope_axes`). What ``rope_pool_fused(positions=None,
    cos_sin_cache=rows)`` rotates a VL model's tokens with."""
    half = cos_sin_cache.shape[1] // 2
    axes = mrope_axes(half, mrope_section, interleaved).to(positions.device)
    rows = positions[axes].t()  # [T, half]: each frequency's row
    i = torch.arange(half, device=cos_sin_cache.device)
    return torch.cat([cos_sin_cache[rows, i], cos_sin_cache[rows, half + i]], dim=1)


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int, is_neox: bool) -> Tensor:
    """x ``[T, H, D]`` -> float64 rotated copy (on the CPU); elements past rotary_dim pass through."""
    x = x.detach().cpu().double()
    out = x.clone()
    c, s = cos[:, None, :], sin[:, None, :]
    rot = rotary_dim
    if is_neox:
        a, b = x[..., : rot // 2], x[..., rot // 2 : rot]
        out[..., : rot // 2] = a * c - b * s
        out[..., rot // 2 : rot] = b * c + a * s
    else:
        a, b = x[..., 0:rot:2], x[..., 1:rot:2]
        out[..., 0:rot:2] = a * c - b * s
        out[..., 1:rot:2] = b * c + a * s
    return out


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float = 1e-6, offset: float = 0.0) -> Tensor:
    """The QK norm of docs/contract.md on ``x [..., head_dim]``, in x's dtype,
    float32 step by step as the kernels compute it (bit-exact with CUDA):
    squares summed pairwise over head_dim padded with zeros to a power of
    two, ``inv = 1 / sqrt(ss / head_dim + eps)``, then ``T(float32(T(x inv)) *
    w)`` with ``offset == 0`` or ``T((x inv) * (offset + w))`` otherwise."""
    dtype, d = x.dtype, x.shape[-1]
    xf = x.detach().cpu().float()
    w = weight.detach().cpu().float()
    padded = 1 << (d - 1).bit_length()
    sq = torch.nn.functional.pad(xf * xf, (0, padded - d))
    while sq.shape[-1] > 1:  # one float32 addition per pair: the order is the tree's
        sq = sq[..., 0::2] + sq[..., 1::2]
    # division and square root each correctly rounded to float32: done in
    # float64 and rounded once (exact for these two operations; torch's
    # float32 sqrt on the CPU is not always correctly rounded)
    mean = (sq.double() / d).float()
    total = mean + torch.tensor(eps, dtype=torch.float32)
    inv = (1.0 / torch.sqrt(total.double()).float().double()).float()
    n = xf * inv
    if offset == 0.0:
        return (n.to(dtype).float() * w).to(dtype)
    return (n * (torch.tensor(offset, dtype=torch.float32) + w)).to(dtype)


def mla_reference(
    q: Tensor,
    kv_c: Tensor,
    k_pe: Tensor,
    positions: Tensor,
    *,
    rope_base: float = 10000.0,
    is_neox: bool = False,
    cos_sin_cache: Optional[Tensor] = None,
    kv_norm_weight: Optional[Tensor] = None,
    norm_eps: float = 1e-6,
) -> Tuple[Tensor, Tensor, Tensor]:
    """mla_rope_pool_fused's results on the CPU: q with its last ``R = k_pe.shape[1]`` elements rotated and k_pe
    rotated, both float64 (:func:`rope_reference`), and the latent kv_c in its dtype (:func:`rms_norm_reference`
    with ``kv_norm_weight``, else kv_c itself)."""
    R = k_pe.shape[1]
    nope = q.shape[2] - R
    cos, sin = cos_sin(positions, R, rope_base, cos_sin_cache)
    q_rot = q.detach().cpu().double().clone()
    q_rot[..., nope:] = rope_reference(q[..., nope:], cos, sin, R, is_neox)
    k_pe_rot = rope_reference(k_pe[:, None], cos, sin, R, is_neox)[:, 0]
    latent = kv_c.detach().cpu() if kv_norm_weight is None else rms_norm_reference(kv_c, kv_norm_weight, norm_eps)
    return q_rot, k_pe_rot, latent


_MANTISSA = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}


def rope_error_ratio(got: Tensor, want: Tensor, x: Tensor, rotary_dim: int, is_neox: bool) -> float:
    """The largest |got - want| over the contract's tolerance (<= 1 passes; NaN gives inf).

    fp16/bf16: float32 arithmetic and one rounding: 1 ulp of the output dtype
    at |want|, plus a few float32 ulp of |x1| + |x2| under cancellation.
    float32: a few float32 ulp of the row's largest magnitude.
    """
    got = got.detach().cpu().double()
    if torch.isnan(got).any():
        return float("inf")
    xd = x.detach().cpu().double()
    partner = xd.abs()
    rot = rotary_dim
    if is_neox:
        h = rot // 2
        partner[..., :h] += xd[..., h:rot].abs()
        partner[..., h:rot] += xd[..., :h].abs()
    else:
        p = partner[..., :rot].clone()
        partner[..., 0:rot:2] += p[..., 1:rot:2]
        partner[..., 1:rot:2] += p[..., 0:rot:2]
    f32_err = 8 * 2.0**-24 * partner
    if x.dtype == torch.float32:
        row_max = want.abs().amax(dim=-1, keepdim=True)
        bound = 8 * 2.0**-24 * torch.maximum(row_max, partner)
    else:
        tiny = torch.finfo(x.dtype).tiny
        e = torch.floor(torch.log2(want.abs().clamp(min=tiny)))
        bound = torch.exp2(e - _MANTISSA[x.dtype]) + f32_err
    err = (got - want).abs()
    return (err / bound).max().item() if err.numel() else 0.0


def quantize_reference(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """fp8 pool contents: ``x / scale`` in float32 (scale: one value or one per
    head of ``x [T, H, D]``), rounded to nearest even, saturated to the
    format's finite range (NaN stays NaN)."""
    s = scale.float().reshape(-1)
    y = x.float() / (s[None, :, None] if s.numel() > 1 else s)
    fmax = torch.finfo(dtype).max
    return y.clamp(-fmax, fmax).to(dtype)


def pool_write_reference(
    pool: Tensor, rows: Tensor, slots: Tensor, kv_layout: str = "NHD", scale: Optional[Tensor] = None
) -> Tensor:
    """A copy of ``pool`` after the op writes ``rows [T, H, D]`` at ``slots``:
    slot s of a paged pool is page s // page_size, offset s % page_size;
    negative slots and slots past the pool are skipped; fp8 pools get
    :func:`quantize_reference` of the rows."""
    out = pool.clone()
    if pool.dim() == 3:
        page_size = 1
    else:
        page_size = pool.shape[1] if kv_layout == "NHD" else pool.shape[2]
    n_slots = pool.shape[0] * page_size
    s = slots.long()
    ok = (s >= 0) & (s < n_slots)
    values = rows[ok] if scale is None else quantize_reference(rows[ok], scale, pool.dtype)
    s = s[ok]
    if pool.dim() == 3:
        out[s] = values
    elif kv_layout == "NHD":
        out[s // page_size, s % page_size] = values
    else:
        out[s // page_size, :, s % page_size] = values
    return out
