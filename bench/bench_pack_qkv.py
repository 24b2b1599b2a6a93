"""Benchmark pack_qkv_destination_major (issue: foundation).

    python bench/bench_pack_qkv.py            # full table
    python bench/bench_pack_qkv.py --quick    # fewer iterations (python -m attnprep)

Per shape: median kernel time, GB/s (q, k, v read once, the packed output
written once) and % of a device-to-device copy of the same bytes, all in one
run, beside the plain-PyTorch composition (cat + permute + contiguous) eager
and under torch.compile. Then CUDA-graph replay per call at rows 1 and 65
(20 calls back to back per graph), with programmatic dependent launch (PDL)
on and off, against an empty kernel (torch.cuda._sleep(0), no PDL) and an
empty kernel launched as attnprep launches (PDL, waiting for its
predecessor); and host overhead per call at rows = 1.
"""

from __future__ import annotations

import argparse
import torch

import attnprep
from attnprep import _bench as common

# (rows, heads, head_size, world, fused slices of one projection?)
SHAPES = [
    (20992, 56, 128, 2, True),
    (7936, 56, 128, 4, True),
    (32768, 24, 128, 8, False),
    (65536, 48, 128, 8, False),
    (4096, 56, 128, 8, False),
    (65, 8, 128, 8, False),
]


def torch_pack(q, k, v, world_size):
    rows, heads, dim = q.shape
    local = heads // world_size
    parts = [t.reshape(rows, world_size, local, 1, dim) for t in (q, k, v)]
    return torch.cat(parts, dim=3).permute(1, 0, 2, 3, 4).reshape(world_size, rows, local, 3 * dim).contiguous()


compiled_pack = torch.compile(torch_pack)


def inputs(rows, heads, dim, fused, dtype=torch.bfloat16):
    if fused:
        qkv = torch.randn(rows, 3 * heads * dim, device="cuda", dtype=dtype)
        return tuple(t.view(rows, heads, dim) for t in qkv.split(heads * dim, dim=1))
    return tuple(torch.randn(rows, heads, dim, device="cuda", dtype=dtype) for _ in range(3))


def run(quick: bool = False, peers: bool = True):
    iters = 10 if quick else 50
    shapes = SHAPES[2:3] + SHAPES[-1:] if quick else SHAPES
    rows_out = []
    for rows, heads, dim, world, fused in shapes:
        nbytes = 2 * 3 * rows * heads * dim * 2  # read q, k, v once + write the packed output once
        sets = [inputs(rows, heads, dim, fused) for _ in range(common.sets_needed(nbytes))]
        outs = [torch.empty(world, rows, heads // world, 3 * dim, device="cuda", dtype=torch.bfloat16) for _ in sets]
        # correctness first, on this data
        for (q, k, v), o in zip(sets, outs):
            attnprep.pack_qkv_destination_major(q, k, v, world, out=o)
            assert torch.equal(o, torch_pack(q, k, v, world)), "pack mismatch"
        t_ours = common.median_ms([lambda s=s, o=o: attnprep.pack_qkv_destination_major(*s, world, out=o)
                                   for s, o in zip(sets, outs)], iters)
        t_alloc = common.median_ms([lambda s=s: attnprep.pack_qkv_destination_major(*s, world) for s in sets], iters)
        t_eager = t_comp = float("nan")
        if peers:
            t_eager = common.median_ms([lambda s=s: torch_pack(*s, world) for s in sets], iters)
            t_comp = common.median_ms([lambda s=s: compiled_pack(*s, world) for s in sets], iters)
        t_copy = common.copy_ms(nbytes // 2, iters)
        del sets, outs
        rows_out.append([f"({rows}, {heads}, {dim}, {world}){' fused' if fused else ''}",
                         t_ours * 1e3, common.gbps(nbytes, t_ours), 100 * t_copy / t_ours,
                         t_alloc * 1e3, t_comp * 1e3, 100 * t_copy / t_comp, t_eager * 1e3, 100 * t_copy / t_eager,
                         t_comp / t_ours])
    common.print_table(
        f"pack_qkv_destination_major, bf16 ({common.environment()})",
        ["(rows, heads, head_size, world)", "attnprep us", "GB/s", "% of copy", "attnprep (alloc) us",
         "torch.compile us", "compile % of copy", "eager us", "eager % of copy", "speed-up vs compile"],
        rows_out)

    small = []
    floor = common.empty_kernel_replay_us()
    with common.pdl(True):
        pdl_floor = common.library_empty_kernel_replay_us()
    for rows in (1, 65):
        q, k, v = inputs(rows, 8, 128, False)
        out = torch.empty(8, rows, 1, 384, device="cuda", dtype=torch.bfloat16)
        times = []
        for on in (True, False):
            with common.pdl(on):
                times.append(common.graph_replay_us(lambda: attnprep.pack_qkv_destination_major(q, k, v, 8, out=out)))
        tc = common.graph_replay_us(lambda: compiled_pack(q, k, v, 8)) if peers else float("nan")
        small.append([rows, times[0], times[1], floor, times[0] / floor, times[1] / floor, pdl_floor, tc])
    common.print_table(
        f"CUDA-graph replay per call, (rows, 8, 128, world 8) bf16 (PDL available: {common.pdl_available()})",
        ["rows", "attnprep us", "attnprep, PDL off us", "empty kernel us", "ratio to empty kernel",
         "ratio, PDL off", "empty PDL kernel us", "torch.compile us"], small)

    if not peers:
        return
    q, k, v = inputs(1, 8, 128, False)
    out = torch.empty(8, 1, 1, 384, device="cuda", dtype=torch.bfloat16)
    q0, k0, v0, out0 = q[:0], k[:0], v[:0], out[:, :0]
    host = [
        ["attnprep (out=)", common.host_us(lambda: attnprep.pack_qkv_destination_major(q, k, v, 8, out=out))],
        ["attnprep (allocating)", common.host_us(lambda: attnprep.pack_qkv_destination_major(q, k, v, 8))],
        ["torch.ops.attnprep (dispatcher)", common.host_us(lambda: torch.ops.attnprep.pack_qkv_destination_major(q, k, v, 8))],
        ["eager PyTorch", common.host_us(lambda: torch_pack(q, k, v, 8))],
        ["torch.compile", common.host_us(lambda: compiled_pack(q, k, v, 8))],
        ["extension called directly (_C, out=)", common.host_us(lambda: attnprep._C.pack_qkv_destination_major(
            q, k, v, 8, out))],
        ["wrapper + binding + checks, rows=0 (nothing launched)", common.host_us(
            lambda: attnprep.pack_qkv_destination_major(q0, k0, v0, 8, out=out0))],
        ["empty kernel (torch.cuda._sleep(0))", common.host_us(lambda: torch.cuda._sleep(0))],
        ["bare launch from C++ (empty kernel)", attnprep._C._empty_launch_us(torch.cuda.current_device(), 2000)],
    ]
    common.print_table("Host overhead per call, rows=1 (2000 calls, no sync)", ["path", "us per call"], host)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-peers", action="store_true", help="no peers, no host-overhead table (tuning runs)")
    a = p.parse_args()
    run(a.quick, not a.no_peers)
