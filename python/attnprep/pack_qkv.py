"""pack_qkv_destination_major: the input side of Ulysses sequence parallelism."""

from __future__ import annotations

from typing import Optional

import torch

from . import _C, _ops  # noqa: F401  (_ops registers torch.ops.attnprep.*)
from ._dispatch import direct, int_arg, tensor_arg


def pack_qkv_destination_major(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    world_size: int,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Pack Q, K, V ``[rows, global_heads, head_size]`` for ONE all_to_all_single.

    Returns ``[world_size, rows, global_heads // world_size, 3 * head_size]``
    (contiguous, same dtype and device), with ``out[d, r, h]`` holding
    ``q[r, d*local + h]``, ``k[...]`` and ``v[...]`` one after another. A
    bit-exact copy; row and head strides of the inputs are arbitrary (slices
    of a fused QKV projection need no copy), the last dimension must be
    unit-stride. Enqueued on the current CUDA stream; safe in CUDA graphs and
    under ``torch.compile``.

    Raises ValueError with the messages of docs/contract.md, in their order.
    """
    if direct(q, k, v, out):
        return _C.pack_qkv_destination_major(q, k, v, world_size, out)
    # as the extension reads them (past int64: 0, which check 5 refuses)
    q, k, v = tensor_arg(q, "q"), tensor_arg(k, "k"), tensor_arg(v, "v")
    world_size = int_arg(world_size, "pack_qkv_destination_major", "world_size", past_int64=0)
    out = tensor_arg(out, "out", optional=True)
    if out is None:
        return torch.ops.attnprep.pack_qkv_destination_major(q, k, v, world_size)
    torch.ops.attnprep.pack_qkv_destination_major_out(q, k, v, world_size, out)
    return out
