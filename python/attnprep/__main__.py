"""`python -m attnprep`: build info, a self-check of every op on the device
found, and a short benchmark.

    python -m attnprep            # all of it
    python -m attnprep --no-bench # build info and self-check only

Exits non-zero when a self-check fails.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

import attnprep
from attnprep import _bench
from attnprep.testing import (
    cos_sin,
    merge_reference,
    mla_reference,
    mrope_cos_sin_rows,
    pack_reference,
    rms_norm_reference,
    rope_error_ratio,
    rope_reference,
)


def _check(name, fn):
    try:
        detail = fn()
    except Exception as e:  # report every op, then fail
        print(f"  FAIL  {name}: {type(e).__name__}: {e}")
        return False
    print(f"  ok    {name}{': ' + detail if detail else ''}")
    return True


def _check_pack():
    qkv = torch.randn(65, 3 * 24 * 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.view(65, 24, 128) for t in qkv.split(24 * 128, 1))
    for w in (1, 2, 3, 4, 8):
        got = attnprep.pack_qkv_destination_major(q, k, v, w)
        if not torch.equal(got, pack_reference(q, k, v, w)):
            raise AssertionError(f"mismatch at world_size={w}")
    return "bit-exact, world_size 1/2/3/4/8, fused-slice bf16 inputs"


def _check_merge():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x = torch.randn(4, 33, 2, 3, 80, device="cuda").to(dtype)
        if not torch.equal(attnprep.usp_merge_heads(x), merge_reference(x)):
            raise AssertionError(f"mismatch for {dtype}")
    return "bit-exact, fp16/bf16/fp32"


def _check_rope():
    T, hq, hkv, d = 65, 8, 2, 128
    q = torch.randn(T, hq, d, device="cuda")
    k = torch.randn(T, hkv, d, device="cuda")
    v = torch.randn(T, hkv, d, device="cuda")
    positions = torch.randint(0, 1 << 16, (T,), device="cuda")
    slots = torch.randperm(2 * T, device="cuda")[:T]
    slots[::5] = -1
    k_pool = torch.zeros(2 * T, hkv, d, device="cuda")
    v_pool = torch.zeros_like(k_pool)
    q_rot, k_rot, _, _ = attnprep.rope_pool_fused(
        q, k, v, positions, slots, k_pool, v_pool, head_dim=d, num_qo_heads=hq, num_kv_heads=hkv, rope_base=10000.0
    )
    cos, sin = cos_sin(positions, d, 10000.0)
    err = rope_error_ratio(q_rot, rope_reference(q, cos, sin, d, True), q, d, True)
    if err > 1:
        raise AssertionError(f"q_rot error {err:.2f}x the documented tolerance")
    ok = slots >= 0
    if not (torch.equal(k_pool[slots[ok]], k_rot[ok]) and torch.equal(v_pool[slots[ok]], v[ok])):
        raise AssertionError("pool rows differ")
    if k_pool.abs().sum(dim=(1, 2)).count_nonzero() != int(ok.sum()):
        raise AssertionError("rows written outside the valid slots")
    return f"fp32 within {err:.2f}x the documented tolerance of float64, pool rows exact, slot -1 skipped"


def _check_mrope():
    T, hq, hkv, d = 33, 4, 2, 128
    q, k, v = (torch.randn(T, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    table = attnprep.rope_cos_sin_cache(d, 1000, 1e6, device="cuda")
    positions = torch.randint(0, 1000, (3, T), device="cuda")
    pools = [torch.zeros(T, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    slots = torch.arange(T, device="cuda")
    kw = dict(head_dim=d, num_qo_heads=hq, num_kv_heads=hkv, rope_base=1e6)
    for section, interleaved in (([16, 24, 24], False), ([24, 20, 20], True)):
        rows = mrope_cos_sin_rows(table, positions, section, interleaved)
        want = attnprep.rope_pool_fused(q, k, v, None, slots, *pools[:2], cos_sin_cache=rows, **kw)
        got = attnprep.rope_pool_fused(
            q,
            k,
            v,
            positions,
            slots,
            *pools[2:],
            cos_sin_cache=table,
            mrope_section=section,
            mrope_interleaved=interleaved,
            **kw,
        )
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            raise AssertionError(f"M-RoPE {section} differs from its gathered rows")
    return "M-RoPE (Qwen2.5-VL sections, Qwen3-VL interleaved) bit-exact with its gathered rows"


def _check_qk_norm_rope():
    B, S, H, D = 2, 33, 4, 128
    q, k = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.rand(H * D, device="cuda") + 0.5  # one RMS over all of a token's heads (Wan)
    rows = attnprep.rope_cos_sin_cache(D, S, 1e4, device="cuda")  # a row per token, shared by the batch
    q_rot, _ = attnprep.qk_norm_rope(q, k, cos_sin_cache=rows, is_neox=False, q_norm_weight=w, k_norm_weight=w)
    normed = rms_norm_reference(q.flatten(-2), w).unflatten(-1, (H, D)).flatten(0, 1)
    cos, sin = cos_sin(torch.arange(S).repeat(B), D, cos_sin_cache=rows)
    want = rope_reference(normed, cos, sin, D, False)
    ratio = rope_error_ratio(q_rot.flatten(0, 1), want, normed, D, False)
    if ratio > 1:
        raise AssertionError(f"error {ratio:.2f}x the tolerance")
    return "batched, the per-token norm then GPT-J RoPE, within the tolerance of float64"


def _check_mla():
    T, H, L, R = 33, 16, 512, 64
    q = torch.randn(T, H, 128 + R, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(T, L + R, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(L, device="cuda") + 0.5
    positions, slots = torch.randint(0, 4096, (T,), device="cuda"), torch.randperm(128, device="cuda")[:T]
    cache = torch.zeros(2, 64, L + R, device="cuda", dtype=torch.bfloat16)
    q_rot, k_pe_rot, _, _ = attnprep.mla_rope_pool_fused(
        q, kv[:, :L], kv[:, L:], positions, slots, cache, kv_norm_weight=w
    )
    want_q, want_pe, latent = mla_reference(q, kv[:, :L], kv[:, L:], positions, kv_norm_weight=w)
    worst = max(
        rope_error_ratio(q_rot[..., -R:], want_q[..., -R:], q[..., -R:], R, False),
        rope_error_ratio(k_pe_rot[:, None], want_pe[:, None], kv[:, None, L:], R, False),
    )
    if worst > 1:
        raise AssertionError(f"error {worst:.2f}x the tolerance")
    rows = cache[slots // 64, slots % 64]
    if not (torch.equal(rows[:, :L].cpu(), latent) and torch.equal(rows[:, L:], k_pe_rot)):
        raise AssertionError("the latent cache rows differ from the normalized kv_c and the rotated k_pe")
    return "DeepSeek-V3's geometry: RoPE within tolerance, the normalized latent bit for bit"


def _check_messages():
    q = torch.randn(4, 8, 16)
    try:
        attnprep.pack_qkv_destination_major(q, q, q, 2)
    except ValueError as e:
        if str(e) != "q, k, and v must be CUDA tensors":
            raise AssertionError(f"unexpected message {e}")
        return "validation reaches Python as ValueError with the documented text"
    raise AssertionError("no ValueError for CPU tensors")


def _short_benchmark():
    rows = []
    qkv = torch.randn(32768, 3 * 24 * 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.view(32768, 24, 128) for t in qkv.split(24 * 128, 1))
    out = torch.empty(8, 32768, 3, 384, device="cuda", dtype=torch.bfloat16)
    nbytes = 2 * out.numel() * 2
    # Each op, its copy and its eager form timed call by call in one loop
    # (_bench.median_ms_interleaved says why).
    t, tc, te = _bench.median_ms_interleaved(
        [
            [lambda: attnprep.pack_qkv_destination_major(q, k, v, 8, out=out)],
            _bench.copy_fns(nbytes // 2),
            [lambda: torch.cat([q, k, v], -1).view(32768, 8, 3, 384).transpose(0, 1).contiguous()],
        ],
        20,
    )
    rows.append(
        ["pack_qkv_destination_major (32768, 24, 128, 8)", t * 1e3, _bench.gbps(nbytes, t), 100 * tc / t, te * 1e3]
    )
    shape = (8, 8192, 1, 3, 128)
    nbytes = 2 * math.prod(shape) * 2
    # input sets rotated as the copy's are (_bench.sets_needed), so that no op reads from L2 what its last call left
    xs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(_bench.sets_needed(nbytes))]
    t, tc, te = _bench.median_ms_interleaved(
        [
            [lambda x=x: attnprep.usp_merge_heads(x) for x in xs],
            _bench.copy_fns(nbytes // 2),
            [lambda x=x: x.permute(2, 1, 0, 3, 4).contiguous() for x in xs],
        ],
        20,
    )
    rows.append(["usp_merge_heads (8, 8192, 1, 3, 128)", t * 1e3, _bench.gbps(nbytes, t), 100 * tc / t, te * 1e3])
    T = 8192
    g = torch.Generator(device="cuda").manual_seed(0)

    def rope_inputs():
        return (
            torch.randn(T, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g),
            torch.randn(T, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g),
            torch.randn(T, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g),
            torch.randint(0, 131072, (T,), device="cuda", generator=g),
            torch.randperm(1 << 18, device="cuda", generator=g)[:T],
        )

    k_pool = torch.empty(1 << 18, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.empty_like(k_pool)
    kw = dict(head_dim=128, num_qo_heads=32, num_kv_heads=8, rope_base=10000.0)
    nbytes = T * (48 * 128 * 2 + 16) + T * 56 * 128 * 2
    sets = [rope_inputs() for _ in range(_bench.sets_needed(nbytes))]
    t, tc = _bench.median_ms_interleaved(
        [[lambda s=s: attnprep.rope_pool_fused(*s, k_pool, v_pool, **kw) for s in sets], _bench.copy_fns(nbytes // 2)],
        20,
    )
    rows.append(["rope_pool_fused (T 8192, 32/8 heads, 128)", t * 1e3, _bench.gbps(nbytes, t), 100 * tc / t, "-"])
    _bench.print_table(
        f"Short benchmark, bf16 ({_bench.environment()})",
        ["op (shape)", "attnprep us", "GB/s", "% of copy", "eager PyTorch us"],
        rows,
    )
    print("\nFull benchmarks, with every peer: python bench/bench_<op>.py (bench/README.md).")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnprep")
    p.add_argument("--no-bench", action="store_true", help="skip the short benchmark")
    args = p.parse_args(argv)

    info = attnprep.build_info()
    print(f"attnprep {info['version']}")
    cuda = f"yes, CUDA {info['cuda_version']}, sm {info['cuda_architectures']}" if info["cuda"] else "not built"
    print(f"  CUDA backend : {cuda}")
    print(f"  Metal backend: {'yes' if info['metal'] else 'not built'}")
    print(f"  torch        : {info['torch']} (tensor import: {info['dlpack_path']})")
    print(f"  device       : {info['device']}")

    print("\nSelf-check")
    ok = _check("validation", _check_messages)
    if torch.cuda.is_available() and info["cuda"]:
        ok &= _check("pack_qkv_destination_major (CUDA)", _check_pack)
        ok &= _check("usp_merge_heads (CUDA)", _check_merge)
        ok &= _check("rope_pool_fused (CUDA)", _check_rope)
        ok &= _check("rope_pool_fused, M-RoPE (CUDA)", _check_mrope)
        ok &= _check("qk_norm_rope (CUDA)", _check_qk_norm_rope)
        ok &= _check("mla_rope_pool_fused (CUDA)", _check_mla)
    else:
        print("  skip  CUDA ops: no CUDA device here" if info["cuda"] else "  skip  CUDA ops: built without CUDA")

    if not args.no_bench:
        if torch.cuda.is_available() and info["cuda"]:
            _short_benchmark()
        else:
            print("\nShort benchmark: skipped (no GPU found; the kernels need one)")
    ran_kernels = torch.cuda.is_available() and info["cuda"]
    if not ok:
        print("\nself-check FAILED")
    elif ran_kernels:
        print("\nself-check passed: every op ran on this GPU and matched its reference")
    else:
        print("\nself-check passed for validation only: no kernel ran (they need a GPU)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
