"""Every CUDA op over its edge cases, for NVIDIA's compute-sanitizer.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --error-exitcode 1 python3 tools/sanitize_ops.py \
        [pack] [merge] [rope | rope-quick] [kv] [norm] [mla]

(tools/gpu_sanitize.sh runs it under memcheck, racecheck, synccheck and
initcheck.) The pytest suite checks the values; this checks the accesses:
memcheck sees an out-of-bounds read or write only past the end of an
allocation, so every tensor here is placed to END exactly where its
allocation ends (`at_end`), and with torch's caching allocator off each
allocation is its own cudaMalloc. A read or write one byte past any input,
output or pool then is a reported error, not a silent one. Results are
compared with the test suite's references all the same (tests/python), so
a run that computes nonsense fails too.

Cases: sizes 0, 1, 17, 65 and ones large enough for the copy engine's
four-vector path and the rope kernel's several rounds; 1-, 2-, 4- and 8-byte
elements; 16-byte and unaligned addresses (the scalar paths); fused-slice
inputs; out=; rope with partial rotary, GPT-J, cos_sin_cache (positions past
its end), int32/int64 indices, slots -1 and >= pool_size, pools that are one
layer of a multi-layer buffer, inplace.
"""

from __future__ import annotations

import itertools
import math
import os
import sys

import attnprep
import torch
from attnprep import _C

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from attnprep.testing import (  # noqa: E402
    cos_sin,
    mla_reference,
    pack_gqa_reference,
    pack_reference,
    pool_write_reference,
    rope_error_ratio,
    rope_reference,
)
from conftest import same_bits  # noqa: E402


def assert_close_to_reference(got, want, x, rotary_dim, is_neox):
    ratio = rope_error_ratio(got, want, x, rotary_dim, is_neox)
    assert ratio <= 1.0, f"error {ratio:.3g}x the bound"


DEV = "cuda"
CASES = 0


def at_end(shape, dtype, strides=None, fill=True):
    """A tensor whose last addressable element is the last one of its own
    allocation (a buffer of a multiple of 512 bytes, the tensor placed at its
    end), so one element past it is outside every allocation."""
    shape = tuple(shape)
    if strides is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= max(n, 1)
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if all(shape) else 0
    item = torch.empty((), dtype=dtype).element_size()
    total = max(1, math.ceil(span * item / 512) * 512 // item)
    buf = torch.empty(total, dtype=dtype, device=DEV)
    if fill:
        if dtype.is_floating_point and item > 1:
            buf.copy_(torch.randn(total, device=DEV).to(dtype))
        else:
            buf.view(torch.uint8).copy_(torch.randint(0, 256, (total * item,), dtype=torch.uint8, device=DEV))
    return buf.as_strided(shape, strides, total - span)


def case(ok: bool, what: str):
    global CASES
    CASES += 1
    if not ok:
        raise AssertionError(what)


def check_pack():
    for dtype in (torch.float8_e4m3fn, torch.bfloat16, torch.float64):
        for world, heads in ((1, 3), (2, 4), (3, 6), (8, 8)):
            for dim in (64, 80):
                for rows in (0, 1, 17, 4099):
                    q, k, v = (at_end((rows, heads, dim), dtype) for _ in range(3))
                    want = pack_reference(q, k, v, world)
                    case(same_bits(attnprep.pack_qkv_destination_major(q, k, v, world), want), f"pack {dtype} {rows}")
                    # slices of one fused projection, which ends where its allocation ends
                    qkv = at_end((rows, 3 * heads * dim), dtype)
                    q, k, v = (t.view(rows, heads, dim) for t in qkv.split(heads * dim, dim=1))
                    out = at_end((world, rows, heads // world, 3 * dim), dtype, fill=False)
                    attnprep.pack_qkv_destination_major(q, k, v, world, out=out)
                    case(same_bits(out, pack_reference(q, k, v, world)), f"pack fused out= {dtype} {rows}")
                    # GQA pack of the Ulysses layer: kv heads split and replicated
                    for kv in {max(1, world // 2), world}:
                        if heads % kv:
                            continue
                        k2, v2 = (at_end((rows, kv, dim), dtype) for _ in range(2))
                        got = _C._pack_qkv_gqa(q, k2, v2, world)[0]
                        case(same_bits(got, pack_gqa_reference(q, k2, v2, world)), f"gqa pack {dtype} {rows} {kv}")


def check_merge():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for shape in ((2, 1, 1, 1, 64), (8, 17, 1, 3, 128), (4, 65, 2, 5, 80), (2, 4099, 1, 8, 128), (3, 0, 1, 2, 64)):
            # contiguous, and a strided view: [S, W, B, h, D] storage read as [W, S, B, h, D]
            for x in (at_end(shape, dtype), at_end((shape[1], shape[0]) + shape[2:], dtype).transpose(0, 1)):
                want = x.permute(2, 1, 0, 3, 4).contiguous()
                case(same_bits(attnprep.usp_merge_heads(x), want), f"merge {shape} strides {x.stride()}")


def check_rope(quick=False):
    """quick: one dtype and two head sizes (for racecheck, the slowest tool)."""
    dtypes = (torch.bfloat16,) if quick else (torch.float16, torch.bfloat16, torch.float32)
    # 72: an odd number of 16-byte groups per head in 16-bit GPT-J (one group per v item)
    for dtype, dim in itertools.product(dtypes, (80, 256) if quick else (64, 72, 80, 256)):
        for rotary_dim, neox, cache_kind in (
            (dim, True, None),
            (dim // 2, True, None),
            (dim, False, None),
            (dim, True, torch.float32),
            (dim // 2, False, torch.bfloat16),
        ):
            for T, idx, inplace in (
                (0, torch.int32, False),
                (1, torch.int64, True),
                (17, torch.int32, True),
                (1100, torch.int64, False),
            ):
                rope_case(dtype, dim, rotary_dim, neox, cache_kind, T, idx, inplace)


def rope_case(dtype, dim, rotary_dim, neox, cache_kind, T, idx, inplace):
    hq, hkv, pool_size, layers, cache_len = 4, 2, 1200, 3, 50
    what = f"rope {dtype} dim {dim} rd {rotary_dim} neox {neox} cache {cache_kind} T {T}"
    qkv = at_end((T, (hq + 2 * hkv) * dim), dtype)
    parts = qkv.split([hq * dim, hkv * dim, hkv * dim], 1)
    q, k, v = (t.view(T, n, dim) for t, n in zip(parts, (hq, hkv, hkv)))
    cache = None
    if cache_kind is not None:
        ang = torch.rand(cache_len, rotary_dim // 2, device=DEV) * 6.3
        cache = at_end((cache_len, rotary_dim), cache_kind)
        cache.copy_(torch.cat([ang.cos(), ang.sin()], dim=1).to(cache_kind))
    top = cache_len + 5 if cache is not None else 1 << 20  # with a table: some positions past its end
    positions = at_end((T,), idx, fill=False)
    positions.copy_(torch.randint(0, top, (T,), device=DEV).to(idx))
    slots = at_end((T,), idx, fill=False)
    slots.copy_(torch.randperm(pool_size + 40, device=DEV)[:T].to(idx) - 20)  # -20 .. pool_size + 19
    # the last layer of a [pool, layers, hkv, dim] buffer: pool rows strided by the layers
    kbuf, vbuf = (at_end((pool_size, layers, hkv, dim), dtype) for _ in range(2))
    k_before, v_before = kbuf.clone(), vbuf.clone()
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    q_rot, k_rot, k_pool, v_pool = attnprep.rope_pool_fused(
        q,
        k,
        v,
        positions,
        slots,
        kbuf[:, -1],
        vbuf[:, -1],
        head_dim=dim,
        num_qo_heads=hq,
        num_kv_heads=hkv,
        rope_base=10000.0,
        rotary_dim=rotary_dim,
        is_neox=neox,
        cos_sin_cache=cache,
        inplace=inplace,
    )

    in_table = positions.long() < cache_len if cache is not None else torch.ones(T, dtype=torch.bool, device=DEV)
    cos, sin = cos_sin(positions[in_table], rotary_dim, 10000.0, cache)
    for got, x in ((q_rot, q0), (k_rot, k0)):
        x = x[in_table]
        assert_close_to_reference(got[in_table], rope_reference(x, cos, sin, rotary_dim, neox), x, rotary_dim, neox)
    case(True, what)
    written = in_table & (slots.long() >= 0) & (slots.long() < pool_size)
    rows = slots.long()[written]
    case(same_bits(v_pool[rows], v0[written]) and same_bits(k_pool[rows], k_rot[written]), what + " pool")
    untouched = torch.ones(pool_size, dtype=torch.bool, device=DEV)
    untouched[rows] = False
    for b, b0 in ((kbuf, k_before), (vbuf, v_before)):
        other_layers = same_bits(b[:, :-1], b0[:, :-1])
        case(other_layers and same_bits(b[:, -1][untouched], b0[:, -1][untouched]), what + " pool rows not addressed")


def check_kv_formats():
    """Paged pools (NHD, HND) that end where their allocations end, fp8 pools
    with per-tensor and per-head scales, slots at page ends, past the pool
    and negative."""
    hq, hkv, dim = 4, 2, 128
    for layout, page, pool_dtype, T in itertools.product(
        ("NHD", "HND"), (16, 64), (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2), (1, 17, 1100)
    ):
        pages = max(4, -(-2 * T // page))
        shape = (pages, page, hkv, dim) if layout == "NHD" else (pages, hkv, page, dim)
        if pool_dtype == torch.bfloat16:
            k_pool, v_pool = (at_end(shape, pool_dtype) for _ in range(2))
        else:  # random finite fp8 bytes, the pool ending where its allocation ends
            k_pool, v_pool = (at_end(shape, torch.uint8, fill=False).view(pool_dtype) for _ in range(2))
            for pool in (k_pool, v_pool):
                pool.view(torch.uint8).copy_(torch.randint(0, 0x78, shape, device=DEV, dtype=torch.uint8))
        q, k, v = (at_end((T, n, dim), torch.bfloat16) for n in (hq, hkv, hkv))
        positions = at_end((T,), torch.int64, fill=False)
        positions.copy_(torch.randint(0, 1 << 16, (T,), device=DEV))
        total = pages * page
        order = torch.randperm(total, device=DEV)
        ends = torch.arange(pages, device=DEV) * page + page - 1
        order = torch.cat([ends, order[~torch.isin(order, ends)]])[:T]
        order[1::7] = -1
        order[3::11] = total + 3
        slots = at_end((T,), torch.int64, fill=False)
        slots.copy_(order)
        scales = {}
        if pool_dtype != torch.bfloat16:
            scales = dict(
                k_scale=at_end((), torch.float32, fill=False).fill_(0.75),
                v_scale=at_end((hkv,), torch.float32, fill=False).fill_(1.5),
            )
        before = (k_pool.clone(), v_pool.clone())
        q_rot, k_rot, _, _ = attnprep.rope_pool_fused(
            q,
            k,
            v,
            positions,
            slots,
            k_pool,
            v_pool,
            head_dim=dim,
            num_qo_heads=hq,
            num_kv_heads=hkv,
            rope_base=1e4,
            kv_layout=layout,
            **scales,
        )
        what = f"kv {layout} page {page} {pool_dtype} T {T}"
        case(
            same_bits(k_pool, pool_write_reference(before[0], k_rot, slots, layout, scales.get("k_scale")))
            and same_bits(v_pool, pool_write_reference(before[1], v, slots, layout, scales.get("v_scale"))),
            what,
        )


def check_qk_norm():
    """The QK-norm kernel: heads of 2 to 512 elements (one lane per head up to
    32), every tensor ending where its allocation ends, paged and fp8 pools,
    inplace, the one-element path; the warp's shared rows under racecheck;
    with a cos_sin_cache (each ending where its allocation ends) the path
    that reads cos/sin and weights straight from their rows, in blocks of one
    round (small calls: k's 2-byte weights and the cos/sin copied into shared
    memory, flat and fp8 pools) and (16/4 heads: 192 items a token) of
    several, where the 2-byte weights are loaded with the item's data; past
    one wave of several-round blocks (10 per multiprocessor for tokens of at
    most 3 rounds, 9 for longer ones: RopeCudaPolicy) a call's last tokens
    in one-round slices (core::plan_rope_cuda_tail; half as many for the
    short tokens), with and without a cos_sin_cache, tokens of 2, 3 and 5
    rounds (16/4, 32/8, 64/8 heads); with rope_base at head_dim 128, the
    block's cos/sin table in blocks of several rounds (fp8 pools) and, in
    small calls, built by the one-round blocks' table warp behind a named
    barrier (float32 weights staged by the item threads, both weights 2-byte
    with 32/8 and 64/8 heads: the table warp's asynchronous weight copy;
    head_dim 512: a table past the inverse frequencies parked before the PDL
    wait)."""
    from attnprep.testing import rms_norm_reference

    past_wave = 10 * torch.cuda.get_device_properties(DEV).multi_processor_count + 57
    for dtype, dim, T, neox, layout, with_cache, (hq, hkv) in [
        (torch.bfloat16, 128, past_wave, True, "flat", True, (16, 4)),
        (torch.float16, 128, past_wave, True, "flat", False, (16, 4)),
        (torch.bfloat16, 128, past_wave, True, "flat", False, (32, 8)),
        (torch.bfloat16, 128, past_wave, True, "flat", True, (64, 8)),
        (torch.float16, 128, 17, True, "flat", False, (64, 8)),
        (torch.bfloat16, 128, 17, True, "flat", False, (6, 2)),
        (torch.bfloat16, 128, 1100, False, "NHD", False, (6, 2)),
        (torch.float32, 80, 33, True, "HND", False, (6, 2)),
        (torch.float16, 2, 5, True, "flat", False, (6, 2)),
        (torch.bfloat16, 512, 9, True, "flat", False, (6, 2)),
        (torch.float32, 64, 3, False, "flat", False, (6, 2)),
        (torch.bfloat16, 128, 1100, True, "NHD", True, (6, 2)),
        (torch.bfloat16, 128, 1100, True, "flat", True, (16, 4)),
        (torch.float32, 80, 33, True, "HND", True, (6, 2)),
        (torch.bfloat16, 512, 9, True, "flat", True, (6, 2)),
        (torch.bfloat16, 128, 17, True, "flat", True, (8, 2)),
        (torch.bfloat16, 128, 17, True, "NHD", True, (8, 2)),
        (torch.bfloat16, 128, 1100, True, "NHD", False, (16, 4)),
        (torch.float32, 128, 17, True, "NHD", False, (8, 2)),
    ]:
        q, k, v = (at_end((T, n, dim), dtype) for n in (hq, hkv, hkv))
        wq = at_end((dim,), dtype if hq >= 32 else torch.float32)
        wk = at_end((dim,), dtype)
        positions = at_end((T,), torch.int64, fill=False)
        cache = None
        if with_cache:  # a bfloat16 table for the 16-bit heads, float32 otherwise
            cache_len = 64
            ang = torch.rand(cache_len, dim // 2, device=DEV) * 6.3
            cache = at_end((cache_len, dim), torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
            cache.copy_(torch.cat([ang.cos(), ang.sin()], dim=1).to(cache.dtype))
        positions.copy_(torch.randint(0, 64 if with_cache else 1 << 16, (T,), device=DEV))
        page = 16
        total = page * max(2, -(-2 * T // page))
        shape = {
            "flat": (total, hkv, dim),
            "NHD": (total // page, page, hkv, dim),
            "HND": (total // page, hkv, page, dim),
        }[layout]
        pool_dtype = torch.float8_e4m3fn if layout == "NHD" else dtype
        if pool_dtype == dtype:
            k_pool, v_pool = (at_end(shape, dtype) for _ in range(2))
        else:
            k_pool, v_pool = (at_end(shape, torch.uint8).view(pool_dtype) for _ in range(2))
        scales = (
            {}
            if pool_dtype == dtype
            else dict(
                k_scale=at_end((), torch.float32, fill=False).fill_(0.5),
                v_scale=at_end((), torch.float32, fill=False).fill_(2.0),
            )
        )
        slots = at_end((T,), torch.int64, fill=False)
        order = torch.randperm(total, device=DEV)[:T]
        order[1::5] = -1
        order[2::7] = total + 1
        slots.copy_(order)
        kn = rms_norm_reference(k, wk, 1e-6, 0.0)
        before = (k_pool.clone(), v_pool.clone())
        inplace = T == 33
        q_rot, k_rot, _, _ = attnprep.rope_pool_fused(
            q,
            k,
            v,
            positions,
            slots,
            k_pool,
            v_pool,
            head_dim=dim,
            num_qo_heads=hq,
            num_kv_heads=hkv,
            rope_base=1e4,
            is_neox=neox,
            kv_layout="NHD" if layout == "flat" else layout,
            inplace=inplace,
            q_norm_weight=wq,
            k_norm_weight=wk,
            cos_sin_cache=cache,
            **scales,
        )
        what = f"norm {dtype} D {dim} T {T} {layout}" + (" cache" if with_cache else "")
        cos, sin = cos_sin(positions, dim, 1e4, cache)
        assert_close_to_reference(k_rot, rope_reference(kn, cos, sin, dim, neox), kn, dim, neox)
        lay = "NHD" if layout == "flat" else layout
        case(
            same_bits(k_pool, pool_write_reference(before[0], k_rot, slots, lay, scales.get("k_scale")))
            and same_bits(v_pool, pool_write_reference(before[1], v, slots, lay, scales.get("v_scale"))),
            what,
        )


def check_mla():
    """mla_rope_pool_fused: T 0/1/17/65/1100, bf16/fp32, 16-byte and unaligned rows (the scalar path), kv_c and k_pe
    slices of one projection output placed at its allocation's end, combined and separate paged caches (bf16 and fp8)
    at theirs, slots -1 and past the cache, cos_sin_cache with positions past its end, in place and fp8 q."""
    for T, dtype, L, offset, separate, fp8 in itertools.product(
        (0, 1, 17, 65, 1100), (torch.bfloat16, torch.float32), (512, 100), (0, 1), (False, True), (False, True)
    ):
        if fp8 and (dtype == torch.float32 or L == 100):
            continue
        H, nope, R = 16, 128, 64
        q = at_end((T, H, nope + R), dtype)
        row = L + R + offset
        kv = at_end((T, row), dtype)
        kv_c, k_pe = kv[:, offset : offset + L], kv[:, offset + L :]
        page, pages = 16, max(1, -(-2 * T // 16))
        cd = torch.float8_e4m3fn if fp8 else dtype
        width = L if separate else L + R
        kv_cache = at_end((pages, page, width), cd, fill=False).fill_(0)
        kpe_cache = at_end((pages, page, R), cd, fill=False).fill_(0) if separate else None
        table = at_end((300, R), torch.float32, fill=False)
        table.copy_(attnprep.rope_cos_sin_cache(R, 300, 1e4, device=DEV))
        positions = at_end((T,), torch.int64, fill=False)
        positions.copy_(torch.randint(0, 301, (T,), device=DEV))  # 300: past the table
        slots = at_end((T,), torch.int32, fill=False)
        order = torch.randperm(pages * page, device=DEV)[:T].int()
        order[1::5] = -1
        order[2::7] = pages * page + 3
        slots.copy_(order)
        w = at_end((L,), torch.float32)
        scales = dict(cache_scale=at_end((), torch.float32, fill=False).fill_(0.5)) if fp8 else {}
        inplace = T == 17 and not fp8
        q_in, pe_in = q.clone(), k_pe.clone()
        q_rot, pe_rot, _, _ = attnprep.mla_rope_pool_fused(
            q,
            kv_c,
            k_pe,
            positions,
            slots,
            kv_cache,
            cos_sin_cache=table,
            kv_norm_weight=w,
            kpe_cache=kpe_cache,
            inplace=inplace,
            q_scale=at_end((), torch.float32, fill=False).fill_(0.25) if fp8 else None,
            **scales,
        )
        what = f"mla {dtype} T {T} L {L} offset {offset}" + (" separate" if separate else "") + (" fp8" if fp8 else "")
        ok = positions < 300
        if not ok.any():
            case(True, what)
            continue
        want_q, want_pe, latent = mla_reference(
            q_in[ok], kv_c[ok], pe_in[ok], positions[ok], cos_sin_cache=table, kv_norm_weight=w
        )
        if not fp8:
            assert_close_to_reference(q_rot[ok][..., nope:], want_q[..., nope:], q_in[ok][..., nope:], R, False)
        assert_close_to_reference(pe_rot[ok][:, None], want_pe[:, None], pe_in[ok][:, None], R, False)
        case(True, what)


class _DeviceMemory:
    """`n` 16-bit elements of device memory at `ptr`, described through the
    CUDA array interface, which torch takes without checking the extent."""

    def __init__(self, ptr: int, n: int):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<u2", "data": (ptr, False), "version": 2}


def planted():
    """The positive control: q claims one row more than its allocation holds
    (a view torch cannot check, made through the CUDA array interface), so
    pack_qkv reads past the end. Under memcheck this run must fail; if it
    passes, the sanitizer (or its kernel filter) is not watching attnprep's
    kernels."""
    rows, heads, dim = 17, 8, 64
    k, v = (at_end((rows + 1, heads, dim), torch.bfloat16) for _ in range(2))
    out = at_end((2, rows + 1, heads // 2, 3 * dim), torch.bfloat16, fill=False)
    q = at_end((rows, heads, dim), torch.bfloat16)  # the last allocation: nothing of ours lies past it
    view = torch.as_tensor(_DeviceMemory(q.data_ptr(), (rows + 1) * heads * dim), device=DEV)
    q_long = view.view(torch.bfloat16).view(rows + 1, heads, dim)
    attnprep.pack_qkv_destination_major(q_long, k, v, 2, out=out)
    torch.cuda.synchronize()
    case(True, "planted")


def main(argv):
    ops = argv or ["pack", "merge", "rope", "kv", "norm", "mla"]
    for op in ops:
        {
            "pack": check_pack,
            "merge": check_merge,
            "rope": check_rope,
            "rope-quick": lambda: check_rope(True),
            "kv": check_kv_formats,
            "norm": check_qk_norm,
            "mla": check_mla,
            "planted": planted,
        }[op]()
        torch.cuda.synchronize()
    print(f"sanitize_ops: {CASES} checks passed ({', '.join(ops)})")


if __name__ == "__main__":
    main(sys.argv[1:])
