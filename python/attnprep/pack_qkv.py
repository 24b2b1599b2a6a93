"""pack_qkv_destination_major: the input side of Ulysses sequence parallelism."""

from __future__ import annotations

from typing import Optional

import torch

from . import _C
from ._dispatch import direct

_OP = "attnprep::pack_qkv_destination_major"


@torch.library.custom_op(_OP, mutates_args=())
def _pack(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, world_size: int) -> torch.Tensor:
    return _C.pack_qkv_destination_major(q, k, v, world_size, None)


@_pack.register_fake
def _(q, k, v, world_size):
    rows, heads, head_size = q.shape
    # The real op raises the documented ValueError for a bad world_size; the
    # fake only has to produce metadata without dividing by zero.
    local = heads // world_size if world_size > 0 else 0
    return q.new_empty((world_size, rows, local, 3 * head_size))


@torch.library.custom_op(_OP + "_out", mutates_args=("out",))
def _pack_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, world_size: int, out: torch.Tensor) -> None:
    _C.pack_qkv_destination_major(q, k, v, world_size, out)


@_pack_out.register_fake
def _(q, k, v, world_size, out):
    return None


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

    Raises ValueError with the messages documented in README.md.
    """
    if direct(q, k, v, out):
        return _C.pack_qkv_destination_major(q, k, v, world_size, out)
    if out is None:
        return torch.ops.attnprep.pack_qkv_destination_major(q, k, v, world_size)
    torch.ops.attnprep.pack_qkv_destination_major_out(q, k, v, world_size, out)
    return out
