"""The peers attnprep is measured against, each at its best.

- Plain PyTorch: several formulations of the same composition (how it is
  written changes its speed a lot); the benchmarks time each, eager and
  compiled, and report the fastest with its name.
- torch.compile: compiled per shape, with static shapes (``dynamic=False``
  after ``torch._dynamo.reset()``), so Inductor specialises as it would in a
  server that compiles per bucket.
- Triton: a per-element kernel of the kind servers ship, one program per
  block of output elements, each element's source address decomposed from
  its flat output index. Skipped where Triton is missing.

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
    def _pack_kernel(q, k, v, out, n, rows, local, dim, q_rs, q_hs, k_rs, k_hs, v_rs, v_hs, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        c = i % (3 * dim)
        t = i // (3 * dim)
        h = t % local
        t = t // local
        r = t % rows
        d = t // rows
        which = c // dim
        e = c % dim
        head = d * local + h
        vq = tl.load(q + r * q_rs + head * q_hs + e, mask=m & (which == 0))
        vk = tl.load(k + r * k_rs + head * k_hs + e, mask=m & (which == 1))
        vv = tl.load(v + r * v_rs + head * v_hs + e, mask=m & (which == 2))
        tl.store(out + i, tl.where(which == 0, vq, tl.where(which == 1, vk, vv)), mask=m)

    @triton.jit
    def _merge_kernel(x, out, n, W, S, B, H, D, sw, ss, sb, sh, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        e = i % D
        t = i // D
        h = t % H
        t = t // H
        w = t % W
        t = t // W
        s = t % S
        b = t // S
        tl.store(out + i, tl.load(x + w * sw + s * ss + b * sb + h * sh + e, mask=m), mask=m)


_BLOCK = 1024


def triton_pack(q, k, v, w):
    rows, heads, dim = q.shape
    out = torch.empty((w, rows, heads // w, 3 * dim), dtype=q.dtype, device=q.device)
    n = out.numel()
    _pack_kernel[(triton.cdiv(n, _BLOCK),)](q, k, v, out, n, rows, heads // w, dim, q.stride(0), q.stride(1),
                                            k.stride(0), k.stride(1), v.stride(0), v.stride(1), BLOCK=_BLOCK)
    return out


def triton_merge(x):
    W, S, B, H, D = x.shape
    assert x.stride(4) == 1
    out = torch.empty((B, S, W, H, D), dtype=x.dtype, device=x.device)
    n = out.numel()
    _merge_kernel[(triton.cdiv(n, _BLOCK),)](x, out, n, W, S, B, H, D, x.stride(0), x.stride(1), x.stride(2),
                                             x.stride(3), BLOCK=_BLOCK)
    return out
