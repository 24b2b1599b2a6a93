"""Packs through the flat path (core::PackFlatPlan, the default) against
the copy engine, in one process, the two paths alternating over 3 rounds.

Small packs (the default): each call timed alone (CUDA events around it,
behind a spin kernel, 8 input sets rotating; attnprep._bench's method) and
under CUDA-graph replay (20 calls per graph, PDL on), at (rows, 8, 128,
world 8) for rows 1, 65 and 512.

Large packs (--large, walked in input order): % of a device copy of the same
bytes at bench/bench_pack_qkv.py's large shapes (its inputs, its method).

    python bench/diagnostics/pack_flat_ab.py [--large]   # on a GPU, after scripts/setup.sh
"""

import argparse
import os
import sys

import torch

import attnprep
from attnprep import _C
from attnprep import _bench as common

ROWS = (1, 65, 512)


def large() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from bench_pack_qkv import SHAPES, inputs

    shapes = [s for s in SHAPES if s[0] * s[1] * s[2] * 3 * 2 // 16 >= 1 << 18]
    pct = {}
    for _ in range(3):
        for flat in (False, True):
            _C._set_pack_flat(flat)
            for rows, heads, dim, world, fused in shapes:
                nbytes = 2 * 3 * rows * heads * dim * 2
                sets = [inputs(rows, heads, dim, fused) for _ in range(common.sets_needed(nbytes))]
                outs = [torch.empty(world, rows, heads // world, 3 * dim, device="cuda", dtype=torch.bfloat16)
                        for _ in sets]
                calls = [lambda s=s, o=o: attnprep.pack_qkv_destination_major(*s, world, out=o)
                         for s, o in zip(sets, outs)]
                t = common.median_ms(calls, 50)
                pct.setdefault((flat, rows), []).append(100 * common.copy_ms(nbytes // 2, 50) / t)
                del sets, outs, calls
    _C._set_pack_flat(True)
    print("| (rows, heads, head_size, world) | engine % of copy | flat % of copy |")
    print("|---|---|---|")
    for rows, heads, dim, world, fused in shapes:
        runs = [" / ".join(f"{x:.1f}" for x in pct[flat, rows]) for flat in (False, True)]
        print(f"| ({rows}, {heads}, {dim}, {world}){' fused' if fused else ''} | {runs[0]} | {runs[1]} |")


def small() -> None:
    times = {}
    for _ in range(3):
        for flat in (False, True):
            _C._set_pack_flat(flat)
            for rows in ROWS:
                sets = [tuple(torch.randn(rows, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                        for _ in range(8)]
                outs = [torch.empty(8, rows, 1, 384, device="cuda", dtype=torch.bfloat16) for _ in sets]
                calls = [lambda s=s, o=o: attnprep.pack_qkv_destination_major(*s, 8, out=o) for s, o in zip(sets, outs)]
                alone = common.median_ms(calls, 200) * 1e3
                replay = common.graph_replay_us(calls[0])
                times.setdefault((flat, rows), []).append((alone, replay))
    _C._set_pack_flat(True)

    def runs(flat, rows, which):
        return " / ".join(f"{t[which]:.3f}" for t in times[flat, rows])

    print("| rows | engine alone us | flat alone us | engine replay us | flat replay us |")
    print("|---|---|---|---|---|")
    for rows in ROWS:
        print(f"| {rows} | {runs(False, rows, 0)} | {runs(True, rows, 0)} | {runs(False, rows, 1)} | "
              f"{runs(True, rows, 1)} |")
    print(f"empty kernel replay: {common.empty_kernel_replay_us():.3f} us")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large", action="store_true", help="the large packs, in % of copy")
    large() if parser.parse_args().large else small()
