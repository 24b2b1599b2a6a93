"""Where a call timed alone spends its time: the benchmark's CUDA-event time
(bench's median_ms: one call behind a spin kernel) beside the kernel's own
duration from the profiler (CUPTI) in the same loop, for rope_pool_fused
(RoPE alone and the QK norm, 32/8 heads, float32 cos_sin_cache, PDL on and
off), the Triton peer of bench/peers.py and torch's copy of the same bytes;
with --pack, pack_qkv_destination_major at (rows, 8, 128, world 8) beside
every compiled formulation of bench/peers.py and its Triton peer. Event time
minus kernel time is what the call pays outside its kernel (launch,
parameter upload, the event's wait for completion).
    python bench/diagnostics/alone_split.py [--tokens 1024,2048,8192]
    python bench/diagnostics/alone_split.py --pack [--rows 1,65,512]"""

import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

import attnprep
from attnprep import _C
from attnprep import _bench as common
from attnprep.testing import pack_reference

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import peers  # noqa: E402

D, POOL, MAXPOS, HKV = 128, 1 << 20, 131072, 8


def kernel_us(fns, match, iters=50):
    """Median duration (us) of the kernels whose name contains `match`, in the loop median_ms times (with
    match "", of every kernel and device copy but the spins: for calls of one kernel)."""
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


def kernels_per_call(fn, calls=8):
    """Kernels and device copies one call of fn launches (the compiled peers' count is theirs to choose)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    n = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return n / calls


def copy_calls(nbytes, n_sets):
    """torch's device copy of nbytes moved (nbytes / 2 read, nbytes / 2 written), over n_sets rotating buffers."""
    src = [torch.empty(max(nbytes // 4, 1), dtype=torch.bfloat16, device="cuda").normal_() for _ in range(n_sets)]
    dst = [torch.empty_like(x) for x in src]
    return [lambda x=x, y=y: y.copy_(x) for x, y in zip(src, dst)]


def pack(rows_list, peers_too=True):
    W, HEADS, DIM = 8, 8, 128
    rows_out = []
    for rows in rows_list:
        nbytes = 2 * 3 * rows * HEADS * DIM * 2
        sets = [tuple(torch.randn(rows, HEADS, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                for _ in range(common.sets_needed(nbytes))]
        outs = [torch.empty(W, rows, HEADS // W, 3 * DIM, device="cuda", dtype=torch.bfloat16) for _ in sets]
        ours = [lambda s=s, o=o: attnprep.pack_qkv_destination_major(*s, W, out=o) for s, o in zip(sets, outs)]
        fns = {"attnprep (out=)": ours,
               # as the peers: a fresh output, which the caching allocator hands back at the same address
               "attnprep (allocating)": [lambda s=s: attnprep.pack_qkv_destination_major(*s, W) for s in sets]}
        for name, f in (peers.PACK_FORMULATIONS.items() if peers_too else ()):
            c = peers.compiled_static(f, *sets[0], W)
            fns["compiled " + name] = [lambda s=s, c=c: c(*s, W) for s in sets]
        if peers_too and peers.triton is not None:
            fns["Triton"] = [lambda s=s: peers.triton_pack(*s, W) for s in sets]
        fns["copy of the bytes"] = copy_calls(nbytes, len(sets))

        def timed(name, fs):
            return [rows, name, 1e3 * common.median_ms(fs), kernel_us(fs, ""), kernels_per_call(fs[0])]

        with common.pdl(False):
            rows_out.append(timed("attnprep (out=), PDL off", ours))
        _C._set_pack_flat(False)  # the copy engine's small path instead of the flat pass
        try:
            rows_out.append(timed("attnprep (out=), copy engine", ours))
        finally:
            _C._set_pack_flat(True)
        for name, fs in fns.items():
            if name.startswith(("compiled", "Triton")):  # each peer returns the send buffer (peers.check)
                for s, f in zip(sets, fs):
                    peers.check(f(), pack_reference(*s, W), name)
            rows_out.append(timed(name, fs))
        for o, s in zip(outs, sets):  # attnprep's outputs after its timed calls
            assert torch.equal(o, pack_reference(*s, W)), "pack mismatch"
    common.print_table("pack (rows, 8, 128, world 8) alone: event time and kernel time (us)",
                       ["rows", "call", "event", "kernel", "kernels per call"], rows_out)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="1024,2048,8192")
    ap.add_argument("--pack", action="store_true", help="pack_qkv_destination_major and its peers instead")
    ap.add_argument("--rows", default="1,65,512")
    ap.add_argument("--ours-only", action="store_true", help="with --pack: attnprep and the copy, no peers")
    a = ap.parse_args()
    if a.pack:
        return pack([int(x) for x in a.rows.split(",")], not a.ours_only)
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
            cp = copy_calls(nbytes, common.sets_needed(nbytes))
            row += [1e3 * common.median_ms(cp), kernel_us(cp, "")]  # the copy: a memcpy or a copy kernel, the spin left out
            rows.append(row)
    common.print_table("a call alone: event time and kernel time (us)",
                       ["case", "T", "attnprep event", "attnprep kernel", "PDL off event", "PDL off kernel",
                        "Triton event", "Triton kernel", "Triton warps", "copy event", "copy kernel"], rows)


if __name__ == "__main__":
    main()
