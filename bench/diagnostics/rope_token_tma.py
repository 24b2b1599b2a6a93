"""rope_token_tma.cu (a token staged in shared memory by bulk copies) against
attnprep.rope_pool_fused on the same inputs: outputs compared byte for byte
(q_rot, k_rot and both pools, some slots negative), then graph replay per
call at T <= 512 and kernel time with % of a copy of the same bytes above:
RoPE alone and with the QK norm, 32/8 and 64/8 heads, and RoPE into fp8
pools (32/8), bf16 q/k/v, float32 cos_sin_cache, flat pools; blocks of 128
and 256 threads, one per token.

    python bench/diagnostics/rope_token_tma.py        # on a GPU, after scripts/setup.sh

Builds the prototype with nvcc into build/diagnostics/ first.
"""

import ctypes
import os
import subprocess
import sys

import torch

import attnprep
from attnprep import _bench as common

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SRC = os.path.join(ROOT, "bench", "diagnostics", "rope_token_tma.cu")
LIB = os.path.join(ROOT, "build", "diagnostics", "rope_token_tma.so")
D, HKV, POOL, MAXPOS = 128, 8, 1 << 20, 131072


def build() -> ctypes.CDLL:
    os.makedirs(os.path.dirname(LIB), exist_ok=True)
    subprocess.run(["nvcc", "-O3", "-std=c++17", "-arch=sm_90", "-I", os.path.join(ROOT, "src"), "-I",
                    os.path.dirname(SRC), "-shared", "-Xcompiler", "-fPIC", SRC, "-o", LIB], check=True)
    lib = ctypes.CDLL(LIB)
    p = ctypes.c_void_p
    lib.rope_token_tma.argtypes = [p] * 14 + [ctypes.c_float, ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_int, p]
    lib.rope_token_tma.restype = ctypes.c_int
    return lib


# (q heads, QK norm, fp8 pools)
CASES = [(32, False, False), (32, True, False), (64, False, False), (64, True, False), (32, False, True)]


def main() -> None:
    lib = build()
    occ = (ctypes.c_int * 10)()
    lib.rope_token_tma_occupancy(occ)
    print("resident blocks per SM (32/8, 32/8 norm, 64/8, 64/8 norm, 32/8 fp8), 128 threads:", list(occ[:5]),
          "256 threads:", list(occ[5:]))
    g = torch.Generator(device="cuda").manual_seed(0)
    table = attnprep.rope_cos_sin_cache(D, MAXPOS, 1e4, device="cuda")
    rows = []
    for hq, norm, fp8 in CASES:
        pool_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        k_pool = torch.zeros(POOL, HKV, D, device="cuda", dtype=pool_dtype)
        v_pool = torch.zeros_like(k_pool)
        wq = torch.rand(D, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5 if norm else None
        wk = torch.rand(D, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5 if norm else None
        k_scale, v_scale = (torch.tensor(0.5, device="cuda"), torch.tensor(2.0, device="cuda")) if fp8 else (None, None)
        kw = dict(head_dim=D, num_qo_heads=hq, num_kv_heads=HKV, rope_base=1e4, cos_sin_cache=table)
        if norm:
            kw.update(q_norm_weight=wq, k_norm_weight=wk)
        if fp8:
            kw.update(k_scale=k_scale, v_scale=v_scale)
        ptr = lambda t: t.data_ptr() if t is not None else 0  # noqa: E731

        def ours(s, qo, ko, threads=128):
            q, k, v, pos, slots = s
            err = lib.rope_token_tma(q.data_ptr(), k.data_ptr(), v.data_ptr(), pos.data_ptr(), slots.data_ptr(),
                                     k_pool.data_ptr(), v_pool.data_ptr(), table.data_ptr(), qo.data_ptr(),
                                     ko.data_ptr(), ptr(wq), ptr(wk), ptr(k_scale), ptr(v_scale),
                                     1e-6 if norm else -1.0, q.shape[0], hq, POOL, threads,
                                     torch.cuda.current_stream().cuda_stream)
            assert err == 0, f"launch failed: cudaError {err}"

        for T in (1, 128, 512, 1024, 2048, 4096, 8192, 32768):
            def inputs():
                slots = torch.randperm(POOL, device="cuda", generator=g)[:T]
                slots[::97] = -1  # skipped pool writes
                return (torch.randn(T, hq, D, device="cuda", dtype=torch.bfloat16, generator=g),
                        torch.randn(T, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g),
                        torch.randn(T, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g),
                        torch.randint(0, MAXPOS, (T,), device="cuda", generator=g), slots)

            pool_bytes = 1 if fp8 else 2
            nbytes = T * ((hq + 2 * HKV) * D * 2 + 16) + T * (hq + HKV) * D * 2 + T * 2 * HKV * D * pool_bytes
            sets = [inputs() for _ in range(common.sets_needed(nbytes))]
            outs = [(torch.empty(T, hq, D, device="cuda", dtype=torch.bfloat16),
                     torch.empty(T, HKV, D, device="cuda", dtype=torch.bfloat16)) for _ in sets]
            # correctness on the first set: pools poisoned alike (0xff bytes), then compared byte for byte
            bytes_of = lambda t: t.view(torch.uint8)  # noqa: E731
            for pl in (k_pool, v_pool):
                bytes_of(pl).fill_(0xFF)
            q_rot, k_rot, _, _ = attnprep.rope_pool_fused(*sets[0], k_pool, v_pool, **kw)
            want = [bytes_of(t).clone() for t in (q_rot, k_rot, k_pool, v_pool)]
            equal = True
            for threads in (128, 256):
                for pl in (k_pool, v_pool):
                    bytes_of(pl).fill_(0xFF)
                for o in outs[0]:
                    bytes_of(o).fill_(0xFF)
                ours(sets[0], *outs[0], threads)
                torch.cuda.synchronize()
                got = [bytes_of(t) for t in (outs[0][0], outs[0][1], k_pool, v_pool)]
                equal = equal and all(torch.equal(a, b) for a, b in zip(got, want))
            del want, got
            name = f"{hq}/{HKV}" + (" norm" if norm else "") + (" fp8" if fp8 else "")
            if T <= 512:  # launch-bound: graph replay per call
                r_lib = common.graph_replay_us(lambda: attnprep.rope_pool_fused(*sets[0], k_pool, v_pool, **kw))
                r128 = common.graph_replay_us(lambda: ours(sets[0], *outs[0], 128))
                r256 = common.graph_replay_us(lambda: ours(sets[0], *outs[0], 256))
                rows.append([name, T, "replay", r_lib, "", r128, "", r256, "", r_lib / min(r128, r256),
                             "equal" if equal else "MISMATCH"])
            else:
                t_lib = common.median_ms([lambda s=s: attnprep.rope_pool_fused(*s, k_pool, v_pool, **kw)
                                          for s in sets], 50)
                t128 = common.median_ms([lambda s=s, o=o: ours(s, *o, 128) for s, o in zip(sets, outs)], 50)
                t256 = common.median_ms([lambda s=s, o=o: ours(s, *o, 256) for s, o in zip(sets, outs)], 50)
                t_copy = common.copy_ms(nbytes // 2, 50)
                rows.append([name, T, "kernel", t_lib * 1e3, 100 * t_copy / t_lib, t128 * 1e3, 100 * t_copy / t128,
                             t256 * 1e3, 100 * t_copy / t256, t_lib / min(t128, t256),
                             "equal" if equal else "MISMATCH"])
    common.print_table("token staged by bulk copies against rope_pool_fused (float32 cos_sin_cache, bf16 q/k/v)",
                       ["case", "T", "timed", "attnprep us", "% of copy", "bulk, 128 threads us", "% of copy",
                        "bulk, 256 threads us", "% of copy", "attnprep / faster bulk", "outputs"], rows)


if __name__ == "__main__":
    sys.exit(main())
