"""The fp8 wire format of the exchanges (docs/contract.md): per row and head
block, fp8 values then a float32 scale. Plain-torch reference and the
dispatch to the CUDA wire kernels."""

from __future__ import annotations

import torch

from .. import _C
from .agreement import _WIRE

Tensor = torch.Tensor


def _to_wire(x: Tensor, wire_dtype) -> Tensor:
    """``x [W, rows, n, D]`` -> the fp8 wire bytes ``[W, rows, row_bytes]``
    (docs/contract.md) in plain torch: the reference of the CUDA wire kernels,
    and the path for CPU tensors and for shapes the kernels do not take."""
    world, rows, n, dim = x.shape
    blocks = x.float()
    amax = blocks.abs().amax(-1)
    top = torch.finfo(wire_dtype).max
    fmax = torch.full_like(amax, top)  # a tensor, so that torch divides (by a scalar it multiplies by a reciprocal)
    scale, inv = amax / fmax, fmax / amax
    usable = (scale > 0) & inv.isfinite()  # else zero, NaN or tiny: scale 1
    scale, inv = torch.where(usable, scale, 1.0), torch.where(usable, inv, 1.0)
    values = (blocks * inv[..., None]).clamp(-top, top).to(wire_dtype)
    wire = torch.zeros(world, rows, _C._wire_row_bytes(n, dim), dtype=torch.uint8, device=x.device)
    wire[..., : n * dim] = values.view(torch.uint8).reshape(world, rows, n * dim)
    wire[..., n * dim : n * dim + 4 * n] = scale.contiguous().view(torch.uint8).reshape(world, rows, 4 * n)
    return wire


def _from_wire(wire: Tensor, n: int, dim: int, wire_dtype, dtype) -> Tensor:
    """The inverse of _to_wire: ``[W, rows, n, D]`` of ``dtype`` (up to the fp8 rounding)."""
    world, rows = wire.shape[:2]
    values = wire[..., : n * dim].contiguous().view(wire_dtype).reshape(world, rows, n, dim)
    scale = wire[..., n * dim : n * dim + 4 * n].contiguous().view(torch.float32).reshape(world, rows, n, 1)
    return (values.float() * scale).to(dtype)


def _quantize(x: Tensor, wire_dtype) -> Tensor:
    """``x [W, rows, n, D]`` (any strides) -> wire bytes, with the CUDA kernel where it applies."""
    world, rows, n, dim = x.shape
    if x.is_cuda:
        wire = torch.empty(world, rows, _C._wire_row_bytes(n, dim), dtype=torch.uint8, device=x.device)
        if _C._wire_quantize(x, _WIRE[wire_dtype], wire):
            return wire
    return _to_wire(x, wire_dtype)


def _dequantize_into(wire: Tensor, x: Tensor, wire_dtype) -> Tensor:
    """Wire bytes -> ``x [W, rows, n, D]`` (written in place, any strides); returns x."""
    if not (x.is_cuda and _C._wire_dequantize(wire, _WIRE[wire_dtype], x)):
        x.copy_(_from_wire(wire, x.shape[2], x.shape[3], wire_dtype, x.dtype))
    return x
