"""usp_merge_heads: the output side of Ulysses sequence parallelism."""

from __future__ import annotations

import torch

from . import _C, _ops  # noqa: F401  (_ops registers torch.ops.attnprep.*)
from ._dispatch import direct, refuse_grad, tensor_arg


def usp_merge_heads(x: torch.Tensor) -> torch.Tensor:
    """Merge the heads received from every rank (the Ulysses output side).

    Bit-exact with ``x.permute(2, 1, 0, 3, 4).contiguous()``, for any input
    strides, on the current CUDA stream.

    Parameters
    ----------
    x : torch.Tensor
        ``[W, S, B, h_local, D]``: what rank ``w`` sent, for ``S`` rows of
        ``B`` sequences; CUDA float16, bfloat16 or float32.

    Returns
    -------
    torch.Tensor
        ``[B, S, W, h_local, D]``, contiguous, same dtype and device.

    Raises
    ------
    TypeError
        ``x`` is not a torch.Tensor.
    ValueError
        The messages of the contract (``contract.md`` in the package), e.g.
        ``"Unsupported usp_merge_heads dtype: torch.float64"``.

    Examples
    --------
    >>> x = torch.randn(4, 1024, 1, 2, 128, device="cuda", dtype=torch.bfloat16)
    >>> usp_merge_heads(x).shape
    torch.Size([1, 1024, 4, 2, 128])
    >>> torch.equal(usp_merge_heads(x), x.permute(2, 1, 0, 3, 4).contiguous())
    True
    """
    if direct(x):
        return _C.usp_merge_heads(x)
    refuse_grad("usp_merge_heads", tensor_arg(x, "x"))
    return torch.ops.attnprep.usp_merge_heads(x)
