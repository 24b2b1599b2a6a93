"""The two exchanges: the input side (q, k, v packed destination-major, one
all_to_all_single, views of the receive buffer) and the output side (one
all_to_all_single, then usp_merge_heads)."""

from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist

from .. import _C
from ..pack_qkv import pack_qkv_destination_major
from ..usp_merge_heads import usp_merge_heads
from .agreement import _GATHER_FIELDS, _WIRE, _agree_on, _checked_chunks, _gather_local, _world
from .wire import _dequantize_into, _quantize, _to_wire

Tensor = torch.Tensor


def _unit_head_dim(*ts: Tensor) -> Tuple[Tensor, ...]:
    """Each tensor, copied to a contiguous one where its head_dim is not
    unit-stride: the pack kernels (and the copy engine's 2-D copies) read
    whole head_dim rows, and a refusal after the agreement would leave the
    other ranks waiting in the exchange."""
    return tuple(t if t.stride(-1) == 1 else t.clone(memory_format=torch.contiguous_format) for t in ts)


def _pack_torch(q: Tensor, k: Tensor, v: Tensor, world: int, chunks: int = 1) -> Tensor:
    """The grouped send buffer in plain torch (CPU tensors), [chunks, W, rows,
    (chunk_q + 2 chunk_kv) * D]: the layout of the CUDA grouped pack."""
    rows, heads, dim = q.shape

    def chunk_major(t: Tensor) -> Tensor:
        n = t.shape[1]
        if n >= world:  # destination d, chunk c: heads d * n/W + c * n/(W chunks) + [0, n/(W chunks))
            return t.reshape(rows, world, chunks, n // world // chunks * dim).permute(2, 1, 0, 3)
        src = torch.arange(world, device=t.device) * n // world  # replicated kv head per destination
        return t[:, src].transpose(0, 1)[None].expand(chunks, world, rows, dim)

    return torch.cat([chunk_major(q), chunk_major(k), chunk_major(v)], dim=-1).contiguous()


def _pack(q: Tensor, k: Tensor, v: Tensor, world: int) -> Tensor:
    """[W, rows, (local_q + 2 local_kv) * D] or, for MHA on CUDA, the public
    [W, rows, local, 3 D] layout; both are split by _unpack."""
    if not q.is_cuda:
        return _pack_torch(q, k, v, world)[0]  # one chunk: [W, rows, n]
    if k.shape[1] == q.shape[1]:
        return pack_qkv_destination_major(q, k, v, world)
    return _C._pack_qkv_gqa(q, k, v, world)[0]  # one chunk: [W, rows, n]


def _unpack(recv: Tensor, q_heads: int, kv_heads: int, dim: int, world: int):
    rows_total = recv.shape[0] * recv.shape[1]
    local_q = q_heads // world
    if recv.dim() == 4:  # public MHA layout: per head q | k | v
        x = recv.view(rows_total, local_q, 3 * dim)
        return x[..., :dim], x[..., dim : 2 * dim], x[..., 2 * dim :]
    local_kv = kv_heads // world if kv_heads >= world else 1
    x = recv.view(rows_total, local_q + 2 * local_kv, dim)
    return x[:, :local_q], x[:, local_q : local_q + local_kv], x[:, local_q + local_kv :]


# usp_merge_heads' dtypes (docs/contract.md); the layer merges others with torch
_MERGE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _merge(x: Tensor) -> Tensor:
    """[W, rows, h, D] received per head group -> [rows, W * h, D]."""
    world, rows, h, dim = x.shape
    if x.is_cuda and x.dtype in _MERGE_DTYPES:
        return usp_merge_heads(x.view(world, rows, 1, h, dim)).view(rows, world * h, dim)
    return x.permute(1, 0, 2, 3).reshape(rows, world * h, dim)


class _Pending:
    """A started exchange: wait() finishes it and returns its result."""

    def __init__(self, work, finish):
        self._work, self._finish = work, finish

    def wait(self):
        if self._work is not None:
            self._work.wait()
        return self._finish()


def _send_layout(q: Tensor, k: Tensor, world: int):
    """The plain send buffer's shape (what _pack returns on q's device) and its head blocks per row."""
    rows, heads, dim = q.shape
    if q.is_cuda and k.shape[1] == heads:
        return (world, rows, heads // world, 3 * dim), 3 * heads // world
    kv = k.shape[1]
    n = heads // world + 2 * (kv // world if kv >= world else 1)
    return (world, rows, n * dim), n


def _pack_wire(q: Tensor, k: Tensor, v: Tensor, world: int, wire_dtype) -> Tensor:
    """q, k, v -> the fp8 wire send buffer: one fused pack + quantize kernel where it applies."""
    shape, n = _send_layout(q, k, world)
    dim = q.shape[2]
    if q.is_cuda:
        wire = torch.empty(world, q.shape[0], _C._wire_row_bytes(n, dim), dtype=torch.uint8, device=q.device)
        if _C._wire_pack_qkv(q, k, v, world, _WIRE[wire_dtype], wire):
            return wire
    return _to_wire(_pack(q, k, v, world).view(world, q.shape[0], n, dim), wire_dtype)


def _exchange(send: Tensor, group, world: int, async_op: bool):
    """One all_to_all_single of ``send``: (work or None, the receive buffer)."""
    if world == 1:
        return None, send
    recv = torch.empty_like(send)
    return dist.all_to_all_single(recv, send, group=group, async_op=async_op), recv


def scatter_heads(
    q: Tensor, k: Tensor, v: Tensor, group=None, async_op: bool = False, validate: bool = True, wire_dtype=None
):
    """The input side alone: this rank's rows of every head to every row of this rank's heads.

    Parameters
    ----------
    q, k, v : torch.Tensor
        As :func:`ulysses_attention` takes them.
    group : torch.distributed.ProcessGroup, optional
        The ranks (default: the world).
    async_op : bool
        Return at once an object whose ``wait()`` gives the result, so that
        independent work overlaps the exchange.
    validate : bool
        Agree on the inputs first (see :func:`ulysses_attention`).
    wire_dtype : torch.dtype, optional
        fp8 on the wire.

    Returns
    -------
    tuple of torch.Tensor
        ``(q, k, v)``, each ``[W * rows, local_heads, D]``, views of one
        receive buffer.

    Raises
    ------
    TypeError, ValueError
        The messages of the contract, the same on every rank.

    Examples
    --------
    >>> ql, kl, vl = scatter_heads(q, k, v)  # doctest: +SKIP
    """
    _checked_chunks(q, k, v, group, validate, 1, wire_dtype)
    return _scatter(q, k, v, group, async_op, wire_dtype)


def _scatter(q: Tensor, k: Tensor, v: Tensor, group, async_op: bool, wire_dtype):
    """scatter_heads after its checks."""
    world, _ = _world(group)
    heads, kv, dim = q.shape[1], k.shape[1], q.shape[2]
    q, k, v = _unit_head_dim(q, k, v)
    if wire_dtype is None:
        work, recv = _exchange(_pack(q, k, v, world), group, world, async_op)
        finish = lambda: _unpack(recv, heads, kv, dim, world)  # noqa: E731
    else:
        work, recv = _exchange(_pack_wire(q, k, v, world, wire_dtype), group, world, async_op)
        shape, n = _send_layout(q, k, world)
        finish = lambda: _received_wire(recv, shape, n, heads, kv, dim, q.dtype, wire_dtype)  # noqa: E731
    return _Pending(work, finish) if async_op else finish()


def _received_wire(recv: Tensor, shape, n: int, heads: int, kv: int, dim: int, dtype, wire_dtype):
    """The received wire rows dequantized into a plain buffer of ``shape`` (``n`` blocks a row): q, k, v views."""
    plain = torch.empty(shape, dtype=dtype, device=recv.device)
    _dequantize_into(recv, plain.view(shape[0], shape[1], n, dim), wire_dtype)
    return _unpack(plain, heads, kv, dim, shape[0])


def _scatter_sent(sent: Tensor, heads: int, kv: int, dim: int, dtype, group, wire_dtype):
    """The exchange of wire rows ``[W, rows, row_bytes]`` packed elsewhere in the grouped layout (the batched
    layer's fused prologue): q, k, v of this rank's heads, views of one plain buffer."""
    world, _ = _world(group)
    n = heads // world + 2 * (kv // world if kv >= world else 1)
    _, recv = _exchange(sent, group, world, False)
    return _received_wire(recv, (world, sent.shape[1], n * dim), n, heads, kv, dim, dtype, wire_dtype)


def gather_heads(out: Tensor, group=None, async_op: bool = False, wire_dtype=None, validate: bool = True):
    """The output side alone: every row of this rank's heads back to this rank's rows of every head.

    Parameters
    ----------
    out : torch.Tensor
        ``[W * rows, local_heads, D]``: attention output of this rank's heads.
    group : torch.distributed.ProcessGroup, optional
        The ranks (default: the world).
    async_op : bool
        Return at once an object whose ``wait()`` gives the result.
    wire_dtype : torch.dtype, optional
        fp8 on the wire.
    validate : bool
        The ranks agree on ``out``'s geometry, dtype and ``wire_dtype`` first.

    Returns
    -------
    torch.Tensor
        ``[rows, heads, D]`` for this rank's rows (merged with
        :func:`attnprep.usp_merge_heads` on CUDA).

    Raises
    ------
    TypeError, ValueError
        The messages of the contract, the same on every rank.

    Examples
    --------
    >>> out = gather_heads(sdpa()(ql, kl, vl))  # doctest: +SKIP
    """
    world, _ = _world(group)
    if validate:
        _agree_on(group, _GATHER_FIELDS, lambda: _gather_local(out, world, wire_dtype))
    else:
        _gather_local(out, world, wire_dtype)
    total, h, dim = out.shape
    rows = total // world
    if wire_dtype is None:
        work, recv = _exchange(out.reshape(world, rows, h, dim).contiguous(), group, world, async_op)
        finish = lambda: _merge(recv)  # noqa: E731
    else:  # quantized as it lies, dequantized straight into the merged layout
        work, recv = _exchange(_quantize(out.reshape(world, rows, h, dim), wire_dtype), group, world, async_op)

        def finish():
            merged = torch.empty(rows, world * h, dim, dtype=out.dtype, device=out.device)
            _dequantize_into(recv, merged.view(rows, world, h, dim).permute(1, 0, 2, 3), wire_dtype)
            return merged

    return _Pending(work, finish) if async_op else finish()
