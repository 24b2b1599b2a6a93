"""Where a call timed alone spends its time: the benchmark's CUDA-event time
(bench's median_ms: one call behind a spin kernel) beside the kernel's own
duration from the profiler (CUPTI) in the same loop, for rope_pool_fused
(RoPE alone and the QK norm, 32/8 heads, float32 cos_sin_cache, PDL on and
off), the Triton peer of bench/peers.py and torch's copy of the same bytes.
Event time minus kernel time is what the call pays outside its kernel
(launch, parameter upload, the event's wait for completion).
    python bench/diagnostics/alone_split.py [--tokens 1024,2048,8192]"""

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

import attnprep
from attnprep import _bench as common

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import peers  # noqa: E402

D, POOL, MAXPOS, HKV = 128, 1 << 20, 131072, 8


def kernel_us(fns, match, iters=50):
    """Median duration (us) of the kernels whose name contains `match`, in the loop median_ms times."""
    for i in range(5):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            torch.cuda._sleep(common.SPIN_CYCLES)
            fns[i % len(fns)]()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    # the spin before each call is torch's spin_kernel (cuda/Sleep.cu)
    d = [e["dur"] for e in events if e.get("cat") in ("kernel", "gpu_memcpy") and match in e.get("name", "")
         and "spin_kernel" not in e.get("name", "") and "sleep" not in e.get("name", "")]
    return statistics.median(d) if d else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="1024,2048,8192")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    table = attnprep.rope_cos_sin_cache(D, MAXPOS, 1e4, device="cuda")
    k_pool = torch.zeros(POOL, HKV, D, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    rows = []
    for norm in (False, True):
        w = (torch.rand(D, device="cuda", dtype=torch.bfloat16) + 0.5,
             torch.rand(D, device="cuda", dtype=torch.bfloat16) + 0.5) if norm else ()
        kw = dict(head_dim=D, num_qo_heads=32, num_kv_heads=HKV, rope_base=1e4, cos_sin_cache=table)
        if norm:
            kw.update(q_norm_weight=w[0], k_norm_weight=w[1])
        for T in [int(x) for x in a.tokens.split(",")]:
            nbytes = T * (48 * D * 2 + 16) + T * 40 * D * 2 + T * 16 * D * 2 + T * D * 4
            sets = [(torch.randn(T, 32, D, device="cuda", dtype=torch.bfloat16, generator=g),
                     torch.randn(T, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g),
                     torch.randn(T, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g),
                     torch.randint(0, MAXPOS, (T,), device="cuda", generator=g),
                     torch.randperm(POOL, device="cuda", generator=g)[:T]) for _ in range(common.sets_needed(nbytes))]
            ours = [lambda s=s: attnprep.rope_pool_fused(*s, k_pool, v_pool, **kw) for s in sets]
            tri = [lambda s=s: peers.triton_rope_pool(*s, k_pool, v_pool, table, *w) for s in sets]
            row = ["norm" if norm else "rope", T]
            for on in (True, False):
                with common.pdl(on):
                    row += [1e3 * common.median_ms(ours), kernel_us(ours, "rope_pool_kernel")]
            row += [1e3 * common.median_ms(tri), kernel_us(tri, "_rope_pool_kernel"), peers.triton_rope_pool_warps()]
            n = max(nbytes // 4, 1)
            src = [torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_() for _ in range(common.sets_needed(nbytes))]
            dst = [torch.empty_like(s) for s in src]
            cp = [lambda s=s, d=d: d.copy_(s) for s, d in zip(src, dst)]
            row += [1e3 * common.median_ms(cp), kernel_us(cp, "")]  # the copy: a memcpy or a copy kernel, the spin left out
            rows.append(row)
    common.print_table("a call alone: event time and kernel time (us)",
                       ["case", "T", "attnprep event", "attnprep kernel", "PDL off event", "PDL off kernel",
                        "Triton event", "Triton kernel", "Triton warps", "copy event", "copy kernel"], rows)


if __name__ == "__main__":
    main()
