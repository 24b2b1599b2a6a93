"""Prints the Triton code Inductor generates for the fastest compiled peers of
pack and merge (bench/peers.py), compiled per shape with static shapes, so
their access pattern can be compared with the copy engine's.

    TORCH_LOGS=output_code python bench/diagnostics/inductor_code.py 2> inductor.log
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import peers  # noqa: E402

rows, heads, dim, world = 4096, 56, 128, 8
q, k, v = (torch.randn(rows, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for name in ("cat(5-D) + permute", "three strided copies"):
    print(f"### pack: {name}", file=sys.stderr)
    peers.compiled_static(peers.PACK_FORMULATIONS[name], q, k, v, world)
x = torch.randn(8, 8192, 1, 3, 128, device="cuda", dtype=torch.bfloat16)
print("### merge: empty + copy_", file=sys.stderr)
peers.compiled_static(peers.MERGE_FORMULATIONS["empty + copy_"], x)
