"""Benchmark pack_qkv_destination_major against its peers at their best.

    python bench/bench_pack_qkv.py            # full tables
    python bench/bench_pack_qkv.py --quick    # fewer shapes and iterations

Per shape, in one run: median kernel time (CUDA events, several input sets
rotated when one fits in L2), GB/s (q, k, v read once, the output written
once) and % of a device-to-device copy of the same bytes; beside it the
fastest plain-PyTorch formulation eager and under torch.compile (compiled per
shape, static; bench/peers.py lists the formulations tried) and a Triton
kernel of the kind servers ship, every one of them, attnprep and the copy
timed call by call in one interleaved loop (common.median_ms_interleaved). Then CUDA-graph replay per call at small
row counts (20 calls per graph) with PDL on and off against an empty kernel,
and host time per call at rows = 1 on each path.
"""

from __future__ import annotations

import argparse

import attnprep
import peers
import torch
from attnprep import _bench as common
from attnprep.testing import pack_reference

# (rows, heads, head_size, world, fused slices of one projection?)
SHAPES = [
    (20992, 56, 128, 2, True),
    (7936, 56, 128, 4, True),
    (32768, 24, 128, 8, False),
    (65536, 48, 128, 8, False),
    (4096, 56, 128, 8, False),
    (65, 8, 128, 8, False),
]


def inputs(rows, heads, dim, fused, dtype=torch.bfloat16):
    if fused:
        qkv = torch.randn(rows, 3 * heads * dim, device="cuda", dtype=dtype)
        return tuple(t.view(rows, heads, dim) for t in qkv.split(heads * dim, dim=1))
    return tuple(torch.randn(rows, heads, dim, device="cuda", dtype=dtype) for _ in range(3))


def run(quick: bool = False, with_peers: bool = True):
    iters = 10 if quick else 50
    shapes = SHAPES[2:3] + SHAPES[-1:] if quick else SHAPES
    table = []
    for rows, heads, dim, world, fused in shapes:
        nbytes = 2 * 3 * rows * heads * dim * 2  # read q, k, v once + write the packed output once
        sets = [inputs(rows, heads, dim, fused) for _ in range(common.sets_needed(nbytes))]
        outs = [torch.empty(world, rows, heads // world, 3 * dim, device="cuda", dtype=torch.bfloat16) for _ in sets]
        for (q, k, v), o in zip(sets, outs):  # correctness first, on this data
            attnprep.pack_qkv_destination_major(q, k, v, world, out=o)
            assert torch.equal(o, pack_reference(q, k, v, world)), "pack mismatch"
        families = {}
        if with_peers:
            families = {
                "eager": dict(peers.PACK_FORMULATIONS),
                "compiled": {
                    name: peers.compiled_static(fn, *sets[0], world) for name, fn in peers.PACK_FORMULATIONS.items()
                },
                "triton": {"triton": peers.triton_pack} if peers.triton else {},
            }
            for fns in families.values():
                for name, fn in fns.items():
                    for s in sets:
                        peers.check(fn(*s, world), pack_reference(*s, world), name)
        # Every contender in one interleaved loop (common.median_ms_interleaved says why).
        contenders = [
            [lambda s=s, o=o: attnprep.pack_qkv_destination_major(*s, world, out=o) for s, o in zip(sets, outs)],
            common.copy_fns(nbytes // 2),
        ]
        contenders += [
            [lambda s=s, fn=fn: fn(*s, world) for s in sets] for fns in families.values() for fn in fns.values()
        ]
        times = common.median_ms_interleaved(contenders, iters)
        t_ours, t_copy, rest = times[0], times[1], times[2:]
        row = [f"({rows}, {heads}, {dim}, {world}){' fused' if fused else ''}", t_ours * 1e3, 100 * t_copy / t_ours]
        if with_peers:
            best_of = peers.fastest_of(families, rest)
            eager, comp, tri = best_of["eager"], best_of["compiled"], best_of["triton"]
            best_peer = min(comp[1], tri[1], eager[1])
            row += [
                comp[1] * 1e3,
                100 * t_copy / comp[1],
                comp[0],
                tri[1] * 1e3,
                100 * t_copy / tri[1],
                eager[1] * 1e3,
                100 * t_copy / eager[1],
                eager[0],
                best_peer / t_ours,
            ]
        table.append(row)
        del sets, outs
    header = ["(rows, heads, head_size, world)", "attnprep us", "% of copy"]
    if with_peers:
        header += [
            "torch.compile us",
            "% of copy",
            "fastest compiled formulation",
            "Triton us",
            "% of copy",
            "eager us",
            "% of copy",
            "fastest eager formulation",
            "best peer / attnprep",
        ]
    common.print_table(f"pack_qkv_destination_major, bf16 ({common.environment()})", header, table)

    small = []
    floor = common.empty_kernel_replay_us()
    for rows in (1, 65, 512):
        q, k, v = inputs(rows, 8, 128, False)
        out = torch.empty(8, rows, 1, 384, device="cuda", dtype=torch.bfloat16)
        times = []
        for on in (True, False):
            with common.pdl(on):
                times.append(common.graph_replay_us(lambda: attnprep.pack_qkv_destination_major(q, k, v, 8, out=out)))
        row = [rows, times[0], times[1], floor, times[0] / floor]
        if with_peers:
            comp = peers.compiled_static(peers.pack_cat_last, q, k, v, 8)
            row += [
                common.graph_replay_us(lambda: comp(q, k, v, 8)),
                common.graph_replay_us(lambda: peers.triton_pack(q, k, v, 8)) if peers.triton else float("nan"),
            ]
        small.append(row)
    header = ["rows", "attnprep us", "attnprep, PDL off us", "empty kernel us", "attnprep / empty kernel"]
    if with_peers:
        header += ["torch.compile us", "Triton us"]
    common.print_table(
        f"CUDA-graph replay per call, (rows, 8, 128, world 8) bf16 (PDL available: {common.pdl_available()})",
        header,
        small,
    )

    if not with_peers:
        return
    q, k, v = inputs(1, 8, 128, False)
    out = torch.empty(8, 1, 1, 384, device="cuda", dtype=torch.bfloat16)
    comp = peers.compiled_static(peers.pack_cat_last, q, k, v, 8)
    direct = common.host_us(lambda: attnprep.pack_qkv_destination_major(q, k, v, 8))
    dispatcher = common.host_us(lambda: torch.ops.attnprep.pack_qkv_destination_major(q, k, v, 8))
    host = [
        ["attnprep (out=)", common.host_us(lambda: attnprep.pack_qkv_destination_major(q, k, v, 8, out=out))],
        ["attnprep (allocating)", direct],
        ["torch.ops.attnprep (dispatcher, as compiled graphs call it)", dispatcher],
        ["dispatcher / direct", dispatcher / direct],
        ["Triton", common.host_us(lambda: peers.triton_pack(q, k, v, 8)) if peers.triton else float("nan")],
        ["torch.compile (static)", common.host_us(lambda: comp(q, k, v, 8))],
        ["empty kernel (torch.cuda._sleep(0))", common.host_us(lambda: torch.cuda._sleep(0))],
    ]
    common.print_table("Host time per call, rows=1 (2000 calls, no sync)", ["path", "us per call"], host)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-peers", action="store_true", help="attnprep only (kernel work)")
    a = p.parse_args()
    run(a.quick, not a.no_peers)
