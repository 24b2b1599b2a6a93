"""Benchmark usp_merge_heads against its peers at their best (bench/peers.py).

    python bench/bench_usp_merge_heads.py [--quick]

Per shape, in one run: median kernel time, % of a device copy of the same
bytes, the fastest plain-PyTorch formulation eager and compiled per shape
(static), and the Triton peer; attnprep, the copy and every formulation
timed call by call in one interleaved loop (common.median_ms_interleaved).
"""

from __future__ import annotations

import argparse
import math

import attnprep
import peers
import torch
from attnprep import _bench as common
from attnprep.testing import merge_reference

SHAPES = [(8, 8192, 1, 3, 128), (8, 4096, 1, 7, 128), (4, 16384, 2, 10, 128), (2, 20992, 1, 28, 128)]


def run(quick: bool = False):
    iters = 10 if quick else 50
    rows = []
    for shape in SHAPES[:1] if quick else SHAPES:
        n = math.prod(shape)
        nbytes = 2 * n * 2
        xs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(common.sets_needed(nbytes))]
        for x in xs:
            assert torch.equal(attnprep.usp_merge_heads(x), merge_reference(x)), "merge mismatch"
        families = {
            "eager": dict(peers.MERGE_FORMULATIONS),
            "compiled": {k: peers.compiled_static(f, xs[0]) for k, f in peers.MERGE_FORMULATIONS.items()},
            "triton": {"triton": peers.triton_merge} if peers.triton else {},
        }
        for fns in families.values():
            for name, fn in fns.items():
                for x in xs:
                    peers.check(fn(x), merge_reference(x), name)
        # Every contender in one interleaved loop (common.median_ms_interleaved says why).
        contenders = [[lambda x=x: attnprep.usp_merge_heads(x) for x in xs], common.copy_fns(n * 2)]
        contenders += [[lambda x=x, fn=fn: fn(x) for x in xs] for fns in families.values() for fn in fns.values()]
        times = common.median_ms_interleaved(contenders, iters)
        t, tcopy, rest = times[0], times[1], times[2:]
        best_of = peers.fastest_of(families, rest)
        eager, comp, tri = best_of["eager"], best_of["compiled"], best_of["triton"]
        best = min(comp[1], tri[1], eager[1])
        rows.append(
            [
                str(shape),
                t * 1e3,
                100 * tcopy / t,
                comp[1] * 1e3,
                100 * tcopy / comp[1],
                comp[0],
                tri[1] * 1e3,
                100 * tcopy / tri[1],
                eager[1] * 1e3,
                100 * tcopy / eager[1],
                best / t,
            ]
        )
    common.print_table(
        f"usp_merge_heads, bf16 ({common.environment()})",
        [
            "(W, S, B, h, D)",
            "attnprep us",
            "% of copy",
            "torch.compile us",
            "% of copy",
            "fastest compiled formulation",
            "Triton us",
            "% of copy",
            "eager us",
            "% of copy",
            "best peer / attnprep",
        ],
        rows,
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    run(p.parse_args().quick)
