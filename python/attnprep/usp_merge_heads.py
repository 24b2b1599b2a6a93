"""usp_merge_heads: the output side of Ulysses sequence parallelism."""

from __future__ import annotations

import torch

from . import _C
from ._dispatch import direct


@torch.library.custom_op("attnprep::usp_merge_heads", mutates_args=())
def _merge(x: torch.Tensor) -> torch.Tensor:
    return _C.usp_merge_heads(x)


@_merge.register_fake
def _(x):
    if x.dim() != 5:  # the real op raises the documented ValueError
        return x.new_empty(x.shape)
    w, s, b, h, d = x.shape
    return x.new_empty((b, s, w, h, d))


def usp_merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``[W, S, B, h_local, D] -> [B, S, W, h_local, D]``, contiguous.

    Bit-exact with ``x.permute(2, 1, 0, 3, 4).contiguous()`` for any input
    strides; CUDA float16, bfloat16 and float32. Other dtypes raise
    ``ValueError("Unsupported usp_merge_heads dtype: torch.float64")`` (etc.).
    """
    if direct(x):
        return _C.usp_merge_heads(x)
    return torch.ops.attnprep.usp_merge_heads(x)
