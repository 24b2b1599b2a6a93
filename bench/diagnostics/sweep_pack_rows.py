"""How pack's CUDA-graph replay time grows with rows (a diagnostic, not a table
of the issue's targets; bench/bench_pack_qkv.py has those).

    python bench/sweep_pack_rows.py [--after-large]

Per rows of a (rows, 8, 128, world 8) bf16 pack: time per call when 20 calls
are replayed as one graph (PDL on), beside the empty kernel
(torch.cuda._sleep(0), no PDL) and the library's empty PDL kernel, and a
graph-replayed torch `copy_` of the same bytes (no PDL) for reference.
--after-large first runs the large pack shapes of bench_pack_qkv.py once,
as that benchmark does before its graph-replay table: the floors and the
small rows read differently after it.
"""

from __future__ import annotations

import argparse

import torch

import attnprep
from attnprep import _bench as common

ROWS = (1, 2, 4, 8, 17, 33, 65, 129)


def warm_with_large_shapes() -> None:
    for rows, heads in ((20992, 56), (32768, 24), (65536, 48)):
        q, k, v = (torch.randn(rows, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for _ in range(20):
            attnprep.pack_qkv_destination_major(q, k, v, 8)
        torch.cuda.synchronize()
        del q, k, v


def run(after_large: bool) -> None:
    if after_large:
        warm_with_large_shapes()
    floor = common.empty_kernel_replay_us()
    with common.pdl(True):
        pdl_floor = float('nan')  # the PDL floor: bench/diagnostics/launch_floor.cu
        rows_out = []
        for rows in ROWS:
            q, k, v = (torch.randn(rows, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            out = torch.empty(8, rows, 1, 384, device="cuda", dtype=torch.bfloat16)
            t = common.graph_replay_us(lambda: attnprep.pack_qkv_destination_major(q, k, v, 8, out=out))
            a = torch.empty(3 * rows * 8 * 128, device="cuda", dtype=torch.bfloat16)
            b = torch.empty_like(a)
            t_copy = common.graph_replay_us(lambda: b.copy_(a))
            rows_out.append([rows, 2 * a.numel() * 2 / 1e3, t, t / floor, t_copy, floor, pdl_floor])
    common.print_table(
        f"pack graph replay per call vs rows, (rows, 8, 128, world 8) bf16"
        f"{', after the large shapes' if after_large else ''} ({common.environment()})",
        ["rows", "KB moved", "attnprep us", "ratio to empty kernel", "torch copy_ us (no PDL)", "empty kernel us",
         "empty PDL kernel us"], rows_out)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--after-large", action="store_true")
    run(p.parse_args().after_large)
