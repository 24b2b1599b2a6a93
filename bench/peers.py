"""The peers attnprep is measured against, each at its best.

- Plain PyTorch: several formulations of the same composition (how it is
  written changes its speed a lot); the benchmarks time each, eager and
  compiled, and report the fastest with its name.
- torch.compile: compiled per shape, with static shapes (``dynamic=False``
  after ``torch._dynamo.reset()``), so Inductor specialises as it would in a
  server that compiles per bucket.
- Triton: a kernel of the kind servers ship, one program per block of
  output elements, each element's source decomposed from its flat index,
  autotuned over block size and warps. Skipped where Triton is missing.

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
    # contiguous before the merge of the last two dims: without it reshape
    # returns a view of the cat in (row, destination) order, the right values
    # in a layout all_to_all_single cannot send
    return torch.cat(parts, 3).permute(1, 0, 2, 3, 4).contiguous().view(w, rows, heads // w, 3 * dim)


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


def fastest_of(families: Dict[str, Dict[str, Callable]], times) -> Dict[str, tuple]:
    """{family: (name, ms) of its fastest formulation} from `times`, the formulations' times in the
    order the families list them (one interleaved loop's medians); ("", nan) for an empty family."""
    rest = iter(times)
    best = {}
    for family, fns in families.items():
        timed = [(name, next(rest)) for name in fns]
        best[family] = min(timed, key=lambda b: b[1]) if timed else ("", float("nan"))
    return best


def check(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """A peer's output: the reference's values in a contiguous tensor of the
    reference's shape, as attnprep returns it (the all_to_all_single send
    buffer, the layout attention reads). Values alone would let a formulation
    return a strided view and skip the reordering being measured."""
    assert got.shape == want.shape and got.is_contiguous(), f"{name}: not a contiguous {tuple(want.shape)} tensor"
    assert torch.equal(got, want), f"{name}: wrong values"


def compiled_static(fn: Callable, *example) -> Callable:
    """fn compiled for exactly these shapes (warmed up once)."""
    torch._dynamo.reset()
    c = torch.compile(fn, dynamic=False)
    c(*example)
    return c


# ---------------------------------------------------------------- Triton
#
# The flat-index kind inference servers ship: one program per BLOCK of output
# elements, each element's source decomposed from its flat index, head_dim a
# compile-time constant (so Triton vectorizes the runs along it), indices in
# int32 where the tensors allow it. BLOCK and num_warps autotuned per size,
# the fastest kept.

if triton is not None:

    def _configs():
        return [triton.Config({"BLOCK": b}, num_warps=w) for b in (1024, 2048, 4096, 8192) for w in (4, 8)]

    @triton.jit
    def _flat_block(n, BLOCK: tl.constexpr, WIDE: tl.constexpr):
        """This program's flat output indices and their in-bounds mask."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        if WIDE:
            i = i.to(tl.int64)
        return i, i < n

    @triton.autotune(configs=_configs(), key=["n", "DIM"])
    @triton.jit
    def _pack_kernel(
        q,
        k,
        v,
        out,
        n,
        rows,
        local,
        q_rs,
        q_hs,
        k_rs,
        k_hs,
        v_rs,
        v_hs,
        DIM: tl.constexpr,
        BLOCK: tl.constexpr,
        WIDE: tl.constexpr,
    ):
        # out[d, r, h, j * DIM + e] = (q, k, v)[j][r, d * local + h, e]
        i, m = _flat_block(n, BLOCK, WIDE)
        e = i % DIM
        t = i // DIM
        j = t % 3
        t = t // 3
        h = t % local
        t = t // local
        r = t % rows
        head = (t // rows) * local + h
        vq = tl.load(q + r * q_rs + head * q_hs + e, mask=m & (j == 0), eviction_policy="evict_last")
        vk = tl.load(k + r * k_rs + head * k_hs + e, mask=m & (j == 1), eviction_policy="evict_last")
        vv = tl.load(v + r * v_rs + head * v_hs + e, mask=m & (j == 2), eviction_policy="evict_last")
        tl.store(out + i, tl.where(j == 0, vq, tl.where(j == 1, vk, vv)), mask=m)

    @triton.autotune(configs=_configs(), key=["n", "DIM"])
    @triton.jit
    def _merge_kernel(x, out, n, W, S, H, sw, ss, sb, sh, DIM: tl.constexpr, BLOCK: tl.constexpr, WIDE: tl.constexpr):
        # out[b, s, w, h, e] = x[w, s, b, h, e]
        i, m = _flat_block(n, BLOCK, WIDE)
        e = i % DIM
        t = i // DIM
        h = t % H
        t = t // H
        w = t % W
        t = t // W
        s = t % S
        b = t // S
        src = x + w * sw + s * ss + b * sb + h * sh + e
        tl.store(out + i, tl.load(src, mask=m, eviction_policy="evict_last"), mask=m)


def _wide(*ts) -> bool:
    """int64 indices where an element offset may not fit in int32."""
    return any(
        t.numel() == 0 or max((s - 1) * st for s, st in zip(t.shape, t.stride())) + t.numel() >= 2**31 for t in ts
    )


def triton_pack(q, k, v, w):
    rows, heads, dim = q.shape
    out = torch.empty((w, rows, heads // w, 3 * dim), dtype=q.dtype, device=q.device)
    n = out.numel()
    _pack_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](
        q,
        k,
        v,
        out,
        n,
        rows,
        heads // w,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        DIM=dim,
        WIDE=_wide(q, k, v, out),
    )
    return out


def triton_merge(x):
    W, S, B, H, D = x.shape
    assert x.stride(4) == 1
    out = torch.empty((B, S, W, H, D), dtype=x.dtype, device=x.device)
    n = out.numel()
    _merge_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](
        x, out, n, W, S, H, x.stride(0), x.stride(1), x.stride(2), x.stride(3), DIM=D, WIDE=_wide(x, out)
    )
    return out


# ---------------------------------------------------------------- Triton RoPE + pool write
#
# The fused kernel of the kind servers ship beside their attention: one
# program per token, its q and k heads as [heads, head_dim / 2] tiles (NeoX
# halves), cos/sin read from the [max_position, head_dim] cos_sin_cache row
# of its position, k and v stored into the flat pool at its slot. With
# NORM, each q and k head is RMS-normalized first as Qwen3 writes it (float32
# inside, rounded, times the weight, rounded). With MROPE (1 sections, 2
# interleaved), positions are [3, T] and each frequency reads the row of its
# axis's position, as vLLM's Triton M-RoPE kernel gathers them.

if triton is not None:

    @triton.jit
    def _norm_rope(x, w, eps, cos, sin, H: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
        """A token's heads of x ([H, 2 HALF] at x): (first, second) rotated halves in x's dtype."""
        c = tl.arange(0, HALF)
        at = tl.arange(0, H)[:, None] * 2 * HALF + c[None, :]
        a = tl.load(x + at).to(tl.float32)
        b = tl.load(x + at + HALF).to(tl.float32)
        if NORM:
            r = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF) + eps)[:, None]
            dt = x.dtype.element_ty
            a = ((a * r).to(dt).to(tl.float32) * tl.load(w + c)[None, :].to(tl.float32)).to(dt).to(tl.float32)
            b = ((b * r).to(dt).to(tl.float32) * tl.load(w + HALF + c)[None, :].to(tl.float32)).to(dt).to(tl.float32)
        return (a * cos - b * sin).to(x.dtype.element_ty), (b * cos + a * sin).to(x.dtype.element_ty)

    @triton.autotune(configs=[triton.Config({}, num_warps=w) for w in (2, 4, 8)], key=["T", "HQ", "HKV", "HALF"])
    @triton.jit
    def _rope_pool_kernel(
        q,
        k,
        v,
        positions,
        slots,
        k_pool,
        v_pool,
        cache,
        q_out,
        k_out,
        wq,
        wk,
        eps,
        T,
        HQ: tl.constexpr,
        HKV: tl.constexpr,
        HALF: tl.constexpr,
        NORM: tl.constexpr,
        MROPE: tl.constexpr,
        S0: tl.constexpr,
        S1: tl.constexpr,
        S2: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots + t).to(tl.int64)
        c = tl.arange(0, HALF)
        if MROPE == 0:
            row = tl.load(positions + t).to(tl.int64) * 2 * HALF + c
        else:
            p0 = tl.load(positions + t).to(tl.int64)
            p1 = tl.load(positions + T + t).to(tl.int64)
            p2 = tl.load(positions + 2 * T + t).to(tl.int64)
            if MROPE == 1:
                axis = (c >= S0).to(tl.int32) + (c >= S0 + S1).to(tl.int32)
            else:
                r = c % 3
                axis = tl.where((r == 1) & (c < 3 * S1), 1, tl.where((r == 2) & (c < 3 * S2), 2, 0))
            row = tl.where(axis == 0, p0, tl.where(axis == 1, p1, p2)) * 2 * HALF + c
        cos = tl.load(cache + row)[None, :]
        sin = tl.load(cache + row + HALF)[None, :]
        qa, qb = _norm_rope(q + t * HQ * 2 * HALF, wq, eps, cos, sin, HQ, HALF, NORM)
        hq = tl.arange(0, HQ)[:, None] * 2 * HALF + c[None, :]
        tl.store(q_out + t * HQ * 2 * HALF + hq, qa)
        tl.store(q_out + t * HQ * 2 * HALF + hq + HALF, qb)
        ka, kb = _norm_rope(k + t * HKV * 2 * HALF, wk, eps, cos, sin, HKV, HALF, NORM)
        hk = tl.arange(0, HKV)[:, None] * 2 * HALF + c[None, :]
        tl.store(k_out + t * HKV * 2 * HALF + hk, ka)
        tl.store(k_out + t * HKV * 2 * HALF + hk + HALF, kb)
        tl.store(k_pool + slot * HKV * 2 * HALF + hk, ka)
        tl.store(k_pool + slot * HKV * 2 * HALF + hk + HALF, kb)
        hv = tl.arange(0, HKV)[:, None] * 2 * HALF + tl.arange(0, 2 * HALF)[None, :]
        tl.store(v_pool + slot * HKV * 2 * HALF + hv, tl.load(v + t * HKV * 2 * HALF + hv))


def triton_rope_pool_warps():
    """The warp count the autotuner chose for the Triton rope peer's last call (NaN if it cannot say)."""
    config = getattr(_rope_pool_kernel, "best_config", None)
    return getattr(config, "num_warps", float("nan"))


def triton_rope_pool(
    q, k, v, positions, slots, k_pool, v_pool, cache, wq=None, wk=None, eps=1e-6, mrope_section=None, interleaved=False
):
    """NeoX RoPE of q and k (and the QK norm when wq, wk are given) with cos/sin from cache, k_rot and v
    into the flat pools at slots; contiguous [T, heads, D] inputs, power-of-two head counts; M-RoPE with
    mrope_section (contiguous [3, T] positions)."""
    sections = mrope_section or (0, 0, 0)
    T, hq, d = q.shape
    hkv = k.shape[1]
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    norm = wq is not None
    if T:
        _rope_pool_kernel[(T,)](
            q,
            k,
            v,
            positions,
            slots,
            k_pool,
            v_pool,
            cache,
            q_out,
            k_out,
            wq if norm else q,
            wk if norm else k,
            eps,
            T,
            HQ=hq,
            HKV=hkv,
            HALF=d // 2,
            NORM=norm,
            MROPE=0 if mrope_section is None else 2 if interleaved else 1,
            S0=sections[0],
            S1=sections[1],
            S2=sections[2],
        )
    return q_out, k_out


# ---------------------------------------------------------------- Triton MLA RoPE + latent-cache write
#
# One program per token, as servers' MLA glue kernels go: q's rope parts as a [heads, R / 2] tile of GPT-J pairs
# rotated in place, k_pe rotated in place, kv_c RMS-normalized as DeepSeek writes it (float32 inside, rounded, times
# the weight), [kv_c | k_pe] stored into the paged bf16 latent cache at the token's slot.

if triton is not None:
    # in place: the autotuner's trial runs must not rotate q and k_pe again
    @triton.autotune(
        configs=[triton.Config({}, num_warps=w) for w in (2, 4, 8)],
        key=["T", "H", "L"],
        restore_value=["q", "k_pe", "cache"],
    )
    @triton.jit
    def _mla_kernel(
        q,
        kv_c,
        k_pe,
        positions,
        slots,
        cache,
        table,
        w,
        eps,
        T,
        q_stride,
        kv_stride,
        pe_stride,
        page_size,
        H: tl.constexpr,
        Q_DIM: tl.constexpr,
        HALF: tl.constexpr,
        L: tl.constexpr,
    ):
        t = tl.program_id(0)
        pos = tl.load(positions + t)
        slot = tl.load(slots + t)
        i = tl.arange(0, HALF)
        cos = tl.load(table + pos * 2 * HALF + i)[None, :]
        sin = tl.load(table + pos * 2 * HALF + HALF + i)[None, :]
        dt = q.dtype.element_ty
        at = t * q_stride + tl.arange(0, H)[:, None] * Q_DIM + (Q_DIM - 2 * HALF) + 2 * i[None, :]
        a = tl.load(q + at).to(tl.float32)
        b = tl.load(q + at + 1).to(tl.float32)
        tl.store(q + at, (a * cos - b * sin).to(dt))
        tl.store(q + at + 1, (b * cos + a * sin).to(dt))
        pa = tl.load(k_pe + t * pe_stride + 2 * i[None, :]).to(tl.float32)
        pb = tl.load(k_pe + t * pe_stride + 2 * i[None, :] + 1).to(tl.float32)
        ra = (pa * cos - pb * sin).to(dt)
        rb = (pb * cos + pa * sin).to(dt)
        tl.store(k_pe + t * pe_stride + 2 * i[None, :], ra)
        tl.store(k_pe + t * pe_stride + 2 * i[None, :] + 1, rb)
        j = tl.arange(0, L)
        x = tl.load(kv_c + t * kv_stride + j).to(tl.float32)
        y = ((x * tl.rsqrt(tl.sum(x * x, 0) / L + eps)).to(dt).to(tl.float32) * tl.load(w + j).to(tl.float32)).to(dt)
        if slot >= 0:
            row = cache + (slot // page_size) * page_size * (L + 2 * HALF) + (slot % page_size) * (L + 2 * HALF)
            tl.store(row + j, y)
            tl.store(row + L + 2 * i[None, :], ra)
            tl.store(row + L + 2 * i[None, :] + 1, rb)


def triton_mla_rope_pool(q, kv_c, k_pe, positions, slots, cache, table, w, eps=1e-6):
    """MLA's RoPE (GPT-J pairs, q's and k_pe's rope parts in place), the norm of kv_c and the write into a
    contiguous paged bf16 latent cache [pages, page_size, L + R]; power-of-two heads, L and R / 2."""
    T, H, q_dim = q.shape
    if T:
        _mla_kernel[(T,)](
            q,
            kv_c,
            k_pe,
            positions,
            slots,
            cache,
            table,
            w,
            eps,
            T,
            q.stride(0),
            kv_c.stride(0),
            k_pe.stride(0),
            cache.shape[1],
            H=H,
            Q_DIM=q_dim,
            HALF=k_pe.shape[1] // 2,
            L=kv_c.shape[1],
        )
    return q, k_pe
