"""The peers attnprep is measured against, each at its best.

- Plain PyTorch: several formulations of the same composition (how it is
  written changes its speed a lot); the benchmarks time each, eager and
  compiled, and report the fastest with its name.
- torch.compile: compiled per shape, with static shapes (``dynamic=False``
  after ``torch._dynamo.reset()``), so Inductor specialises as it would in a
  server that compiles per bucket.
- Triton: a kernel of the kind servers ship, one program per output row,
  each element's source decomposed from its index in the row. Skipped where
  Triton is missing.

Used by the benchmarks only; attnprep.testing holds the references.
"""

from __future__ import annotations

from typing import Callable, Dict

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the Triton peer is skipped
    triton = None


# ---------------------------------------------------------------- pack


def pack_cat5d(q, k, v, w):
    rows, heads, dim = q.shape
    parts = [t.reshape(rows, w, heads // w, 1, dim) for t in (q, k, v)]
    return torch.cat(parts, 3).permute(1, 0, 2, 3, 4).reshape(w, rows, heads // w, 3 * dim)


def pack_cat_last(q, k, v, w):
    rows, heads, dim = q.shape
    return torch.cat([q, k, v], -1).view(rows, w, heads // w, 3 * dim).permute(1, 0, 2, 3).contiguous()


def pack_stack(q, k, v, w):
    rows, heads, dim = q.shape
    return torch.stack([q, k, v], 2).view(rows, w, heads // w, 3 * dim).transpose(0, 1).contiguous()


def pack_copies(q, k, v, w):
    rows, heads, dim = q.shape
    out = torch.empty((w, rows, heads // w, 3, dim), dtype=q.dtype, device=q.device)
    for j, t in enumerate((q, k, v)):
        out[:, :, :, j].copy_(t.view(rows, w, heads // w, dim).transpose(0, 1))
    return out.view(w, rows, heads // w, 3 * dim)


PACK_FORMULATIONS: Dict[str, Callable] = {
    "cat(5-D) + permute": pack_cat5d,
    "cat(last dim) + permute": pack_cat_last,
    "stack + transpose": pack_stack,
    "three strided copies": pack_copies,
}


# ---------------------------------------------------------------- merge


def merge_permute(x):
    return x.permute(2, 1, 0, 3, 4).contiguous()


def merge_copy(x):
    w, s, b, h, d = x.shape
    out = torch.empty((b, s, w, h, d), dtype=x.dtype, device=x.device)
    out.copy_(x.permute(2, 1, 0, 3, 4))
    return out


MERGE_FORMULATIONS: Dict[str, Callable] = {"permute + contiguous": merge_permute, "empty + copy_": merge_copy}


def compiled_static(fn: Callable, *example) -> Callable:
    """fn compiled for exactly these shapes (warmed up once)."""
    torch._dynamo.reset()
    c = torch.compile(fn, dynamic=False)
    c(*example)
    return c


# ---------------------------------------------------------------- Triton

if triton is not None:

    @triton.jit
    def _pack_kernel(q, k, v, out, rows, local, dim, q_rs, q_hs, k_rs, k_hs, v_rs, v_hs, BLOCK: tl.constexpr):
        # one program per output row (d, r, h): its q | k | v segments
        row = tl.program_id(0).to(tl.int64)
        h = row % local
        t = row // local
        r = t % rows
        d = t // rows
        head = d * local + h
        c = tl.arange(0, BLOCK)
        m = c < 3 * dim
        which = c // dim
        e = c % dim
        vq = tl.load(q + r * q_rs + head * q_hs + e, mask=m & (which == 0))
        vk = tl.load(k + r * k_rs + head * k_hs + e, mask=m & (which == 1))
        vv = tl.load(v + r * v_rs + head * v_hs + e, mask=m & (which == 2))
        tl.store(out + row * 3 * dim + c, tl.where(which == 0, vq, tl.where(which == 1, vk, vv)), mask=m)

    @triton.jit
    def _merge_kernel(x, out, W, S, H, D, sw, ss, sb, sh, BLOCK: tl.constexpr):
        # one program per output row (b, s, w, h)
        row = tl.program_id(0).to(tl.int64)
        h = row % H
        t = row // H
        w = t % W
        t = t // W
        s = t % S
        b = t // S
        e = tl.arange(0, BLOCK)
        m = e < D
        tl.store(out + row * D + e, tl.load(x + w * sw + s * ss + b * sb + h * sh + e, mask=m), mask=m)


def triton_pack(q, k, v, w):
    rows, heads, dim = q.shape
    out = torch.empty((w, rows, heads // w, 3 * dim), dtype=q.dtype, device=q.device)
    _pack_kernel[(w * rows * (heads // w),)](q, k, v, out, rows, heads // w, dim, q.stride(0), q.stride(1),
                                             k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                             BLOCK=triton.next_power_of_2(3 * dim))
    return out


def triton_merge(x):
    W, S, B, H, D = x.shape
    assert x.stride(4) == 1
    out = torch.empty((B, S, W, H, D), dtype=x.dtype, device=x.device)
    _merge_kernel[(B * S * W * H,)](x, out, W, S, H, D, x.stride(0), x.stride(1), x.stride(2), x.stride(3),
                                    BLOCK=triton.next_power_of_2(D))
    return out
