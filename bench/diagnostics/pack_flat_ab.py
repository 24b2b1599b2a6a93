"""Small packs through the flat path (core::PackFlatPlan, the default)
against the copy engine, in one process: each call timed alone (CUDA events
around it, behind a spin kernel, 8 input sets rotating; attnprep._bench's
method) and under CUDA-graph replay (20 calls per graph, PDL on), at (rows,
8, 128, world 8) for rows 1, 65 and 512, the two paths alternating over 3
rounds.

    python bench/diagnostics/pack_flat_ab.py     # on a GPU, after scripts/setup.sh
"""

import torch

import attnprep
from attnprep import _C
from attnprep import _bench as common

ROWS = (1, 65, 512)


def main() -> None:
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
    main()
