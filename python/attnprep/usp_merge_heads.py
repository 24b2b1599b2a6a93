"""usp_merge_heads: the output side of Ulysses sequence parallelism."""

from __future__ import annotations

import torch

from . import _C, _ops  # noqa: F401  (_ops registers torch.ops.attnprep.*)
from ._dispatch import direct, tensor_arg


def usp_merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``[W, S, B, h_local, D] -> [B, S, W, h_local, D]``, contiguous.

    Bit-exact with ``x.permute(2, 1, 0, 3, 4).contiguous()`` for any input
    strides; CUDA float16, bfloat16 and float32. Other dtypes raise
    ``ValueError("Unsupported usp_merge_heads dtype: torch.float64")`` (etc.).
    """
    if direct(x):
        return _C.usp_merge_heads(x)
    return torch.ops.attnprep.usp_merge_heads(tensor_arg(x, "x"))
