"""pack_qkv_destination_major: the input side of Ulysses sequence parallelism."""

from __future__ import annotations

from typing import Optional

import torch

from . import _C, _ops  # noqa: F401  (_ops registers torch.ops.attnprep.*)
from ._dispatch import direct, int_arg, refuse_grad, tensor_arg


def pack_qkv_destination_major(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, world_size: int, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Pack q, k and v for one ``all_to_all_single`` (the Ulysses input side).

    A bit-exact copy: ``out[d, r, h]`` holds ``q[r, d * local + h]``, then
    ``k[...]``, then ``v[...]``, where ``local = global_heads // world_size``.
    Enqueued on the current CUDA stream; safe in CUDA graphs and under
    ``torch.compile``.

    Parameters
    ----------
    q, k, v : torch.Tensor
        ``[rows, global_heads, head_size]`` each, one CUDA device and dtype
        (float16, bfloat16, float32 or any other 1/2/4/8-byte type); any row
        and head strides (slices of a fused QKV projection need no copy), a
        unit-stride last dimension.
    world_size : int
        Ranks of the all-to-all; divides ``global_heads``.
    out : torch.Tensor, optional
        Written in place when given: contiguous, the result's shape, dtype
        and device, overlapping no input.

    Returns
    -------
    torch.Tensor
        ``[world_size, rows, global_heads // world_size, 3 * head_size]``,
        contiguous (``out`` when given).

    Raises
    ------
    TypeError
        An argument of the wrong type (``"q must be a torch.Tensor, got list"``).
    ValueError
        The messages of the contract (``contract.md`` in the package), in
        their order, with the offending values as a note.

    Examples
    --------
    >>> q, k, v = (torch.randn(65, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    >>> send = pack_qkv_destination_major(q, k, v, 4)
    >>> send.shape
    torch.Size([4, 65, 2, 384])
    >>> torch.equal(send[1, :, 0, 128:256], k[:, 2])
    True
    """
    if direct(q, k, v, out):
        return _C.pack_qkv_destination_major(q, k, v, world_size, out)
    # as the extension reads them (past int64: 0, which check 5 refuses)
    q, k, v = tensor_arg(q, "q"), tensor_arg(k, "k"), tensor_arg(v, "v")
    world_size = int_arg(world_size, "pack_qkv_destination_major", "world_size", past_int64=0)
    out = tensor_arg(out, "out", optional=True)
    refuse_grad("pack_qkv_destination_major", q, k, v, out)
    if out is None:
        return torch.ops.attnprep.pack_qkv_destination_major(q, k, v, world_size)
    torch.ops.attnprep.pack_qkv_destination_major_out(q, k, v, world_size, out)
    return out
