"""Benchmark usp_merge_heads against permute(2, 1, 0, 3, 4).contiguous().

    python bench/bench_usp_merge_heads.py [--quick]
"""

from __future__ import annotations

import argparse
import torch

import attnprep
from attnprep import _bench as common

SHAPES = [(8, 8192, 1, 3, 128), (4, 16384, 2, 10, 128), (2, 20992, 1, 28, 128)]


def torch_merge(x):
    return x.permute(2, 1, 0, 3, 4).contiguous()


compiled_merge = torch.compile(torch_merge)


def run(quick: bool = False):
    iters = 10 if quick else 50
    rows = []
    for shape in SHAPES[:1] if quick else SHAPES:
        n = 1
        for s in shape:
            n *= s
        nbytes = 2 * n * 2
        xs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(common.sets_needed(nbytes))]
        for x in xs:
            assert torch.equal(attnprep.usp_merge_heads(x), torch_merge(x)), "merge mismatch"
        t = common.median_ms([lambda x=x: attnprep.usp_merge_heads(x) for x in xs], iters)
        te = common.median_ms([lambda x=x: torch_merge(x) for x in xs], iters)
        tc = common.median_ms([lambda x=x: compiled_merge(x) for x in xs], iters)
        tcopy = common.copy_ms(n * 2, iters)
        rows.append([str(shape), t * 1e3, common.gbps(nbytes, t), 100 * tcopy / t, tc * 1e3, 100 * tcopy / tc,
                     te * 1e3, 100 * tcopy / te])
    common.print_table(f"usp_merge_heads, bf16 ({common.environment()})",
                       ["(W, S, B, h, D)", "attnprep us", "GB/s", "% of copy", "torch.compile us",
                        "compile % of copy", "eager us", "eager % of copy"], rows)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    run(p.parse_args().quick)
