"""usp_merge_heads against the Triton peer of bench/peers.py, timed two ways
in one process: each call alone (the benchmark's method: one call behind a
spin kernel, CUDA events around it, the two ops' calls interleaved as
common.median_ms_interleaved times them; timed one after the other, a
median moves with the measurement before it: measure_history.py) and back
to back under CUDA-graph replay (every input set once per replay, time per
call). A gap that shows alone and not under replay lies at a call's start
or end, not in its steady copy.
    python bench/diagnostics/merge_alone_replay.py   # on a GPU, after scripts/setup.sh"""

import math
import os
import sys

import torch

import attnprep
from attnprep import _bench as common

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import peers  # noqa: E402

SHAPES = [(8, 8192, 1, 3, 128), (8, 4096, 1, 7, 128), (2, 20992, 1, 28, 128)]

for shape in SHAPES:
    n = math.prod(shape)
    xs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(common.sets_needed(4 * n))]
    assert torch.equal(attnprep.usp_merge_heads(xs[0]), peers.triton_merge(xs[0]))
    for rep in range(2):
        ev_a, ev_t = common.median_ms_interleaved([[lambda x=x: attnprep.usp_merge_heads(x) for x in xs],
                                                   [lambda x=x: peers.triton_merge(x) for x in xs]])
        g_a = common.graph_replay_us(lambda: [attnprep.usp_merge_heads(x) for x in xs], calls=4, replays=20) / len(xs)
        g_t = common.graph_replay_us(lambda: [peers.triton_merge(x) for x in xs], calls=4, replays=20) / len(xs)
        print(f"| {shape} | alone: attnprep {ev_a * 1e3:.2f} Triton {ev_t * 1e3:.2f} us (Triton / attnprep {ev_t / ev_a:.3f})"
              f" | replay: attnprep {g_a:.2f} Triton {g_t:.2f} us (Triton / attnprep {g_t / g_a:.3f}) |")
    print(f"| {shape} | Triton config | {peers._merge_kernel.best_config} |")
