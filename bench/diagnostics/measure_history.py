"""Why the copy benchmarks time their contenders interleaved: a large copy's
time alone depends on the measurement before it.

usp_merge_heads at two shapes, in one process: timed eight times in a row
with bench's median_ms (each a median of 50 calls alone, the output's
address printed beside it), then eight times each after an L2 flush (a
256 MB write), then beside the Triton peer of bench/peers.py and a copy of
the same bytes, call by call in one interleaved loop
(common.median_ms_interleaved), three times.
    python bench/diagnostics/measure_history.py   # on a GPU, after scripts/setup.sh"""

import math
import os
import sys

import torch

import attnprep
from attnprep import _bench as common

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import peers  # noqa: E402

SHAPES = [(8, 8192, 1, 3, 128), (8, 4096, 1, 7, 128)]
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

for shape in SHAPES:
    n = math.prod(shape)
    xs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(common.sets_needed(4 * n))]
    assert torch.equal(attnprep.usp_merge_heads(xs[0]), peers.triton_merge(xs[0]))
    places = set()

    def merge(x):
        out = attnprep.usp_merge_heads(x)
        places.add(out.data_ptr())
        return out

    t_copy = common.copy_ms(2 * n, 50)
    in_a_row = []
    for _ in range(8):
        places.clear()
        t = common.median_ms([lambda x=x: merge(x) for x in xs], 50)
        in_a_row.append(f"{100 * t_copy / t:.1f} (out {', '.join(hex(p) for p in sorted(places))})")
    print(f"| {shape} | % of copy, eight in a row | {'; '.join(in_a_row)} |")
    flushed = []
    for _ in range(8):
        flush.zero_()
        flushed.append(f"{100 * t_copy / common.median_ms([lambda x=x: merge(x) for x in xs], 50):.1f}")
    print(f"| {shape} | % of copy, each after an L2 flush | {' '.join(flushed)} |")
    for _ in range(3):
        t_a, t_t, t_c = common.median_ms_interleaved([[lambda x=x: attnprep.usp_merge_heads(x) for x in xs],
                                                      [lambda x=x: peers.triton_merge(x) for x in xs],
                                                      common.copy_fns(2 * n)])
        print(f"| {shape} | interleaved, % of copy | attnprep {100 * t_c / t_a:.1f} Triton {100 * t_c / t_t:.1f}"
              f" (Triton / attnprep {t_t / t_a:.3f}) |")
