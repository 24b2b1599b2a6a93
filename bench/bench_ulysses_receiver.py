"""The Ulysses receiver on one GPU: attention on views of the receive buffer (what the batched layer gives
attention) against attention after copying q, k and v out of it.

    python bench/bench_ulysses_receiver.py [--quick]

Per shape, the receive buffer of one rank as the exchange fills it (bf16, [world, rows, B, n, D]: every source
rank's rows, row-major with the batch inner, q | k | v heads of this rank), then, interleaved: torch SDPA on the
[B, S, h, D] views (attnprep.ulysses.batched.sequence_views); the three `.contiguous()` copies alone; the copies
then SDPA. Wan 2.1-14B at 720p (75600 tokens, 40 heads) and Flux at 1024^2 (4608 tokens, 24 heads), batch 2 (a
classifier-free-guidance pair), on 2 to 8 ranks.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from attnprep import _bench as common
from attnprep.ulysses.batched import sequence_views

SHAPES = [  # (model, tokens, heads, world)
    ("Wan 2.1-14B 720p", 75600, 40, 8),
    ("Flux 1024^2", 4608, 24, 2),
    ("Flux 1024^2", 4608, 24, 4),
    ("Flux 1024^2", 4608, 24, 8),
]
B, D = 2, 128


def attention(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def run(quick: bool = False):
    rows = []
    for model, tokens, heads, world in SHAPES[1:2] if quick else SHAPES:
        h, per_rank = heads // world, tokens // world
        recv = torch.randn(world * per_rank * B, 3 * h, D, device="cuda", dtype=torch.bfloat16)
        q, k, v = (sequence_views(recv[:, i * h : (i + 1) * h], world, B) for i in range(3))
        assert q.data_ptr() == recv.data_ptr() and q.stride(-1) == 1, "not a view of the receive buffer"
        want = attention(q.contiguous(), k.contiguous(), v.contiguous())
        assert torch.allclose(attention(q, k, v), want, rtol=1e-2, atol=1e-2), "attention on the views differs"
        iters = 5 if tokens > 20000 else 30
        ms = common.median_ms_interleaved(
            [
                [lambda: attention(q, k, v)],
                [lambda: (q.contiguous(), k.contiguous(), v.contiguous())],
                [lambda: attention(q.contiguous(), k.contiguous(), v.contiguous())],
            ],
            iters,
        )
        rows.append([model, f"{B} x {world * per_rank}", f"{h} of {heads}", world] + [m * 1e3 for m in ms])
        rows[-1].append(ms[2] / ms[0])
    common.print_table(
        f"Ulysses receiver: attention on views of the receive buffer, bf16, head_dim {D} ({common.environment()})",
        ["model", "B x S", "heads here", "world", "SDPA on views us", "three copies us", "copies + SDPA us"]
        + ["(copies + SDPA) / views"],
        rows,
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    run(p.parse_args().quick)
