"""Ulysses sequence parallelism on torch.distributed.

Each rank holds a shard of the sequence, ``[rows, heads, head_dim]``. The
layer exchanges heads for sequence with ONE all_to_all_single on the input
side (q, k and v packed together by :func:`pack_qkv_destination_major`, or
its grouped-query variant), runs attention over the whole sequence with the
rank's share of the heads, and exchanges back with one all_to_all_single and
:func:`usp_merge_heads`. The result equals attention over the whole sequence
on one device, sliced to the rank's rows.

Works with NCCL on CUDA tensors and with gloo on CPU tensors (there the
packing and merging are done with plain torch; the public ops stay CUDA-only).

    import torch.distributed as dist
    from attnprep.ulysses import UlyssesAttention

    dist.init_process_group("nccl")
    layer = UlyssesAttention(causal=True)
    out = layer(q, k, v)          # q [rows, H, D], k/v [rows, H_kv, D] on this rank

Grouped-query attention: ``H_kv`` must divide ``H`` and either be a multiple
of the world size (each rank gets ``H_kv / W`` kv heads) or divide it (each
rank gets the one kv head its q heads use; replicated across ranks).

Ranks agree before any data moves: with ``validate=True`` (the default) one
small all_gather carries every rank's geometry and the verdict of its local
checks, so that a bad input on any rank, or ranks that disagree on rows,
heads, head_dim or dtype, make EVERY rank raise the same ValueError and none
waits in a collective (docs/contract.md lists the messages). The layer is for
inference: inputs that require grad, with grad mode on, are refused.
Any dtype works: the output side merges float16/bfloat16/float32 with
usp_merge_heads and other dtypes (float64, say) with torch's permute.
"""

from __future__ import annotations

import zlib
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import _C, _peer
from .pack_qkv import pack_qkv_destination_major
from .usp_merge_heads import usp_merge_heads

Tensor = torch.Tensor
AttnFn = Callable[[Tensor, Tensor, Tensor], Tensor]


def sdpa(causal: bool = False, scale: Optional[float] = None) -> AttnFn:
    """Default attention: ``[S, h, D]`` q/k/v -> ``[S, h, D]`` through
    torch's scaled_dot_product_attention; k/v with fewer heads are repeated
    to q's heads (grouped-query attention)."""

    def attn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=causal, scale=scale)
        return out[0].transpose(0, 1)

    return attn


def _world(group) -> Tuple[int, int]:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"ulysses: group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    return dist.get_world_size(group), dist.get_rank(group)


def _check_geometry(q: Tensor, k: Tensor, v: Tensor, world: int) -> None:
    _C._check_ulysses_geometry(q, k, v, world)  # the messages live in src/core, once


INFERENCE_ONLY = "ulysses: the layer is inference-only; q, k and v must not require grad (use torch.no_grad())"


def _unit_head_dim(*ts: Tensor) -> Tuple[Tensor, ...]:
    """Each tensor, copied to a contiguous one where its head_dim is not
    unit-stride: the pack kernels (and the copy engine's 2-D copies) read
    whole head_dim rows, and a refusal after the agreement would leave the
    other ranks waiting in the exchange."""
    return tuple(t if t.stride(-1) == 1 else t.clone(memory_format=torch.contiguous_format) for t in ts)


def _check_local(q: Tensor, k: Tensor, v: Tensor, world: int) -> None:
    _check_geometry(q, k, v, world)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise ValueError(INFERENCE_ONLY)


# What every rank tells the others before any data moves: its geometry, then
# the verdict of its local checks (0: passed, 1: ValueError, 2: TypeError)
# with the message as UTF-8 bytes, one per int64.
_FIELDS = ("rows", "q heads", "kv heads", "head_dim", "dtype", "chunks", "wire_dtype", "transport", "causal")
_WIRE = {None: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
_TRANSPORTS = {"nccl": 0, "copy_engine": 1}
_MESSAGE_BYTES = 240
# A dtype as the agreement sends it: the CRC-32 of its name, the same in
# every process (and every torch release), and distinct for each of torch's
# dtypes (tests/python/test_ulysses.py), so that ranks with different dtypes
# never agree.
_DTYPE_CODES = {zlib.crc32(str(d).encode()): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


# chunks="auto" over NCCL: on two H200s (bench/README.md) splitting the
# heads made the layer slower at every measured shape, causal or not
# (attention slows down while NCCL's kernels share the GPU with it, by more
# than the exchange the split hides), so "auto" does not split there. Over
# the copy engines "auto" is _peer.auto_plan. Explicit counts always split.
AUTO_CHUNKS = 1
# "auto" in the agreement's chunks field (a count is positive)
_AUTO_FIELD = 0


def _saturated(n: int) -> int:
    """A count for the C++ checks (int64 arguments): one past int64 fails
    them as any count above the heads does."""
    return max(-2**62, min(n, 2**62))


def _local_chunks(heads: int, kv: int, world: int, chunks) -> int:
    """The chunk count checked against this rank's heads: a positive int, or
    _AUTO_FIELD for "auto"."""
    local_q, split = heads // world, kv >= world
    local_kv = kv // world if split else 1
    if isinstance(chunks, str) and chunks == "auto":
        return _AUTO_FIELD
    if isinstance(chunks, bool) or not isinstance(chunks, int):
        raise TypeError(f"ulysses: chunks must be an int or \"auto\", got {type(chunks).__name__}")
    _C._check_ulysses_chunks(local_q, local_kv, split, _saturated(chunks))
    return chunks


def _plan(rows: int, heads: int, kv: int, world: int, chunks: int, transport: str) -> Tuple[int, ...]:
    """Each chunk's q heads of a rank's local heads, from a checked count
    (or _AUTO_FIELD); ``rows`` per rank."""
    local_q, split = heads // world, kv >= world
    if chunks == _AUTO_FIELD:
        if transport != "copy_engine":
            return _peer.equal_plan(local_q, AUTO_CHUNKS)
        return _peer.auto_plan(local_q, kv // world if split else 1, split, world * rows)
    return _peer.equal_plan(local_q, chunks)


def _wire_code(wire_dtype, chunks=1) -> int:
    if wire_dtype not in _WIRE:
        raise ValueError("ulysses: wire_dtype must be None, torch.float8_e4m3fn or torch.float8_e5m2")
    if wire_dtype is not None and chunks not in (1, _AUTO_FIELD):
        raise ValueError("ulysses: wire_dtype needs chunks=1")
    return _WIRE[wire_dtype]


def _transport_code(transport, q: Tensor, wire_dtype) -> int:
    if not isinstance(transport, str) or transport not in _TRANSPORTS:
        raise ValueError("ulysses: transport must be \"nccl\" or \"copy_engine\"")
    if transport == "copy_engine" and (not q.is_cuda or wire_dtype is not None):
        raise ValueError(_peer.NEEDS)
    return _TRANSPORTS[transport]


def _causal_code(attn_fn, causal) -> int:
    """The layer's attention checked on every rank before the exchange (a
    rank whose attention raised after it would leave the others waiting in
    the exchange back): attn_fn callable, causal a bool, agreed on."""
    if attn_fn is not None and not callable(attn_fn):
        raise TypeError(f"ulysses: attn_fn must be callable or None, got {type(attn_fn).__name__}")
    if not isinstance(causal, bool):
        raise TypeError(f"ulysses: causal must be a bool, got {type(causal).__name__}")
    return int(causal)


def _dtype_code(dtype) -> int:
    return zlib.crc32(str(dtype).encode())


def _describe(fields: Tuple[str, ...], local: Callable[[], list]) -> Tensor:
    """What this rank tells the others: the values of ``fields`` that
    ``local()`` returns after this rank's local checks, or the verdict of
    those checks with the message."""
    n = len(fields)
    info = torch.zeros(n + 1 + _MESSAGE_BYTES, dtype=torch.int64)
    try:
        info[:n] = torch.tensor(local())
    except (ValueError, TypeError) as e:
        info[n] = 1 if isinstance(e, ValueError) else 2
        text = str(e).encode()[:_MESSAGE_BYTES]
        info[n + 1: n + 1 + len(text)] = torch.tensor(list(text), dtype=torch.int64)
    return info


def _shown(field: str, x: int):
    if field == "dtype":
        return _DTYPE_CODES.get(x, "another dtype")
    if field == "wire_dtype":
        return next(d for d, c in _WIRE.items() if c == x)
    if field == "transport":
        return next(t for t, c in _TRANSPORTS.items() if c == x)
    if field == "chunks" and x == _AUTO_FIELD:
        return "auto"
    if field == "causal":
        return bool(x)
    return x


VALIDATE_IN_CAPTURE = ("ulysses: validate=True cannot run inside CUDA-graph capture (the ranks agree through a "
                       "collective whose result the host reads); make one call with validate=True before capturing "
                       "and pass validate=False inside the capture")


def _agree_on(group, fields: Tuple[str, ...], local: Callable[[], list]) -> list:
    """Every rank raises the same error, or none does: one all_gather of each
    rank's _describe; returns the values every rank agreed on. ``fields``
    starts with "rows"."""
    # before the collective: inside a capture it would be recorded, not run,
    # and reading its result would invalidate the capture with a CUDA error
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise ValueError(VALIDATE_IN_CAPTURE)
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = _describe(fields, local).to(device)
    every = [torch.empty_like(mine) for _ in range(_world(group)[0])]
    dist.all_gather(every, mine, group=group)
    every = [t.cpu() for t in every]
    n = len(fields)
    for rank, info in enumerate(every):
        verdict = int(info[n])
        if verdict:
            text = bytes(int(b) for b in info[n + 1:] if b).decode(errors="replace")
            raise (ValueError if verdict == 1 else TypeError)(f"ulysses: rank {rank}: {text}")
    rows = [int(t[0]) for t in every]
    if len(set(rows)) != 1:
        raise ValueError(f"ulysses: every rank must hold the same number of rows, got {rows}")
    for i, field in enumerate(fields[1:], start=1):
        values = [int(t[i]) for t in every]
        if len(set(values)) != 1:
            shown = "[" + ", ".join(str(_shown(field, x)) for x in values) + "]"
            raise ValueError(f"ulysses: every rank must pass the same {field}, got {shown}")
    return [int(x) for x in every[0][:n]]


def _layer_fields(q, k, v, world: int, chunks=1, wire_dtype=None, transport="nccl", attn_fn=None,
                  causal=False) -> list:
    """The layer's (and scatter_heads') local checks, in order; returns its _FIELDS."""
    _check_local(q, k, v, world)
    count = _local_chunks(q.shape[1], k.shape[1], world, chunks)
    wire = _wire_code(wire_dtype, count)
    how = _transport_code(transport, q, wire_dtype)
    attention = _causal_code(attn_fn, causal)
    return [q.shape[0], q.shape[1], k.shape[1], q.shape[2], _dtype_code(q.dtype), count, wire, how, attention]


def _checked_chunks(q, k, v, group, validate: bool, *args) -> int:
    """The local checks (``validate``: and the agreement) of _layer_fields'
    arguments after q, k, v; returns the chunk count (_AUTO_FIELD for "auto")."""
    world, _ = _world(group)
    fields = (_agree_on(group, _FIELDS, lambda: _layer_fields(q, k, v, world, *args)) if validate
              else _layer_fields(q, k, v, world, *args))
    return fields[_FIELDS.index("chunks")]


GATHER_SHAPE = "ulysses: out must be [world_size * rows, local_heads, head_dim]"
# gather_heads' agreement: rows per rank, then the rest of out's geometry
_GATHER_FIELDS = ("rows", "local heads", "head_dim", "dtype", "wire_dtype")


def _gather_local(out, world: int, wire_dtype) -> list:
    """gather_heads' local checks; returns its _GATHER_FIELDS."""
    if not isinstance(out, Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dim() != 3 or out.shape[0] % world != 0:
        raise ValueError(GATHER_SHAPE)
    wire = _wire_code(wire_dtype)
    return [out.shape[0] // world, out.shape[1], out.shape[2], _dtype_code(out.dtype), wire]


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
        return x[..., :dim], x[..., dim: 2 * dim], x[..., 2 * dim:]
    local_kv = kv_heads // world if kv_heads >= world else 1
    x = recv.view(rows_total, local_q + 2 * local_kv, dim)
    return x[:, :local_q], x[:, local_q: local_q + local_kv], x[:, local_q + local_kv:]


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
    wire[..., n * dim: n * dim + 4 * n] = scale.contiguous().view(torch.uint8).reshape(world, rows, 4 * n)
    return wire


def _from_wire(wire: Tensor, n: int, dim: int, wire_dtype, dtype) -> Tensor:
    """The inverse of _to_wire: ``[W, rows, n, D]`` of ``dtype`` (up to the fp8 rounding)."""
    world, rows = wire.shape[:2]
    values = wire[..., : n * dim].contiguous().view(wire_dtype).reshape(world, rows, n, dim)
    scale = wire[..., n * dim: n * dim + 4 * n].contiguous().view(torch.float32).reshape(world, rows, n, 1)
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


def scatter_heads(q: Tensor, k: Tensor, v: Tensor, group=None, async_op: bool = False, validate: bool = True,
                  wire_dtype=None):
    """Input side: the local sequence shard of all heads -> the whole sequence
    of this rank's heads, with one all_to_all_single (fp8 on the wire with
    ``wire_dtype``).

    Returns ``(q, k, v)`` each ``[W * rows, local_heads, D]`` (views of one
    receive buffer), or with ``async_op=True`` an object whose ``wait()``
    returns them, so independent work can overlap the exchange."""
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

        def finish():
            plain = torch.empty(shape, dtype=q.dtype, device=q.device)
            _dequantize_into(recv, plain.view(world, shape[1], n, dim), wire_dtype)
            return _unpack(plain, heads, kv, dim, world)
    return _Pending(work, finish) if async_op else finish()


def gather_heads(out: Tensor, group=None, async_op: bool = False, wire_dtype=None, validate: bool = True):
    """Output side: ``[W * rows, local_heads, D]`` attention output of this
    rank's heads -> ``[rows, heads, D]`` for the local shard, with one
    all_to_all_single (fp8 on the wire with ``wire_dtype``) and usp_merge_heads.
    With ``validate`` the ranks first agree on out's geometry, dtype and
    wire_dtype (one small all_gather), so that a bad ``out`` on any rank
    makes every rank raise instead of leaving the others in the exchange."""
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


# ---------------------------------------------------------------- pack-free input side


def destination_major_qkv_weight(w_q: Tensor, w_k: Tensor, w_v: Tensor, world_size: int, head_dim: int,
                                 b_q: Optional[Tensor] = None, b_k: Optional[Tensor] = None,
                                 b_v: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """The q, k, v projection weights (``nn.Linear`` layout) rearranged once so
    that one batched GEMM writes the destination-major send buffer.

    Returns ``(weight [W, n, hidden], bias [W, n] or None)``; row block d
    holds destination d's rows: per head q | k | v for MHA (the layout of
    pack_qkv_destination_major), q heads then kv heads then v heads for GQA
    (the layer's grouped layout). docs/contract.md has the details."""
    if not (all(isinstance(w, Tensor) and w.dim() == 2 for w in (w_q, w_k, w_v))
            and w_q.shape[1] == w_k.shape[1] == w_v.shape[1] and w_q.dtype == w_k.dtype == w_v.dtype):
        raise ValueError("ulysses: w_q, w_k and w_v must be 2-D [heads * head_dim, hidden] with one hidden size "
                         "and dtype")
    if not (isinstance(head_dim, int) and head_dim > 0
            and all(w.shape[0] % head_dim == 0 for w in (w_q, w_k, w_v))):
        raise ValueError("ulysses: head_dim must be positive and divide the rows of w_q, w_k and w_v")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"ulysses: world_size must be an int, got {type(world_size).__name__}")
    heads, kv = w_q.shape[0] // head_dim, w_k.shape[0] // head_dim
    meta = lambda n: torch.empty(1, n, head_dim, device="meta")  # noqa: E731  (the geometry checks, no data)
    _check_geometry(meta(heads), meta(kv), meta(w_v.shape[0] // head_dim), _saturated(world_size))
    biases = (b_q, b_k, b_v)
    if any(b is not None for b in biases) and not all(
            isinstance(b, Tensor) and b.shape == (w.shape[0],) for b, w in zip(biases, (w_q, w_k, w_v))):
        raise ValueError("ulysses: b_q, b_k and b_v must be given together, each [heads * head_dim] of its weight")
    # heads as rows of [heads, head_dim, hidden] (bias: [heads, head_dim]); the
    # same head selection builds the weight and the bias
    def per_head(t, n):
        return t.reshape(n, head_dim, -1)

    def destination(parts_q, parts_k, parts_v, d):
        local_q = heads // world_size
        qs = list(range(d * local_q, (d + 1) * local_q))
        if kv == heads:  # MHA: per head q | k | v
            return torch.cat([torch.stack([parts_q[h], parts_k[h], parts_v[h]]) for h in qs]).reshape(
                -1, parts_q.shape[-1])
        if kv >= world_size:
            ks = list(range(d * (kv // world_size), (d + 1) * (kv // world_size)))
        else:
            ks = [qs[0] // (heads // kv)]
        return torch.cat([parts_q[qs], parts_k[ks], parts_v[ks]]).reshape(-1, parts_q.shape[-1])

    pq, pk, pv = per_head(w_q, heads), per_head(w_k, kv), per_head(w_v, kv)
    weight = torch.stack([destination(pq, pk, pv, d) for d in range(world_size)]).contiguous()
    bias = None
    if b_q is not None:
        bq, bk, bv = (b.reshape(-1, head_dim, 1) for b in biases)
        bias = torch.stack([destination(bq, bk, bv, d)[:, 0] for d in range(world_size)]).contiguous()
    return weight, bias


def project_destination_major(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x [rows, hidden]`` -> the send buffer ``[W, rows, n]``, one batched GEMM."""
    if not (isinstance(x, Tensor) and x.dim() == 2 and x.shape[1] == weight.shape[2] and x.dtype == weight.dtype):
        raise ValueError("ulysses: x must be [rows, hidden] with the weight's hidden size and dtype")
    if bias is None:
        return torch.matmul(x, weight.transpose(1, 2))
    return torch.baddbmm(bias[:, None, :], x.expand(weight.shape[0], *x.shape), weight.transpose(1, 2))


class UlyssesQKVProjection(torch.nn.Module):
    """The q, k, v projection of a Ulysses layer that writes the send buffer
    directly (no pack pass), then exchanges it: ``forward(x)`` returns what
    :func:`scatter_heads` returns for the projected q, k, v."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor], heads: int, kv_heads: int, head_dim: int,
                 group=None, validate: bool = True):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        self.heads, self.kv_heads, self.head_dim, self.group, self.validate = heads, kv_heads, head_dim, group, validate

    @classmethod
    def from_weights(cls, w_q, w_k, w_v, world_size, head_dim, b_q=None, b_k=None, b_v=None, group=None,
                     validate=True):
        weight, bias = destination_major_qkv_weight(w_q, w_k, w_v, world_size, head_dim, b_q, b_k, b_v)
        return cls(weight, bias, w_q.shape[0] // head_dim, w_k.shape[0] // head_dim, head_dim, group, validate)

    def forward(self, x: Tensor, async_op: bool = False):
        world, _ = _world(self.group)
        if self.weight.shape[0] != world:
            raise ValueError(f"ulysses: the weights were arranged for {self.weight.shape[0]} ranks, the group has "
                             f"{world}")
        if self.validate:
            # the ranks agree on rows, heads, head_dim and dtype, as scatter_heads does (metadata only)
            grad = isinstance(x, Tensor) and x.requires_grad
            rows = x.shape[0] if isinstance(x, Tensor) and x.dim() == 2 else -1
            q, k, v = (torch.empty(max(rows, 0), n, self.head_dim, device="meta",
                                   dtype=x.dtype if isinstance(x, Tensor) else torch.float32, requires_grad=grad)
                       for n in (self.heads, self.kv_heads, self.kv_heads))
            _checked_chunks(q, k, v, self.group, True)
        send = project_destination_major(x, self.weight, self.bias)
        if self.heads == self.kv_heads:
            send = send.view(world, x.shape[0], self.heads // world, 3 * self.head_dim)
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=async_op) if world > 1 else None
        if world == 1:
            recv = send
        finish = lambda: _unpack(recv, self.heads, self.kv_heads, self.head_dim, world)  # noqa: E731
        return _Pending(work, finish) if async_op else finish()


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group=None, attn_fn: Optional[AttnFn] = None,
                      causal: bool = False, validate: bool = True, chunks=1, wire_dtype=None,
                      transport: str = "nccl") -> Tensor:
    """Attention over the whole sequence for this rank's shard.

    ``q`` ``[rows, H, D]``, ``k``/``v`` ``[rows, H_kv, D]`` (the local rows of
    the sequence, in rank order). ``attn_fn(q, k, v)`` takes and returns
    ``[S, h, D]`` (default: scaled_dot_product_attention, ``causal`` as
    given). ``chunks`` > 1 splits each rank's heads into that many groups
    and overlaps the exchange of one group with attention on the previous
    one, both ways (``"auto"``: over NCCL AUTO_CHUNKS, no split; over the
    copy engines growing chunks with a small first and last one,
    _peer.auto_plan).
    ``wire_dtype`` (fp8) halves the bytes of both exchanges.
    ``transport="copy_engine"`` moves the bytes with the GPUs' copy engines
    instead of NCCL's kernels (one node, peer access; docs/contract.md).
    Returns ``[rows, H, D]``."""
    chunks = _checked_chunks(q, k, v, group, validate, chunks, wire_dtype, transport, attn_fn, causal)
    attn = _checked(attn_fn or sdpa(causal))
    if transport == "nccl" and (chunks == 1 or (chunks == _AUTO_FIELD and AUTO_CHUNKS == 1)):
        ql, kl, vl = _scatter(q, k, v, group, False, wire_dtype)
        return gather_heads(attn(ql, kl, vl), group, wire_dtype=wire_dtype, validate=False)  # attn's result is checked
    return _chunked_attention(q, k, v, group, attn, chunks, transport)


def _checked(attn: AttnFn) -> AttnFn:
    """attn, its result checked before anything reads it: a tensor of its q's
    shape on q's device (the exchange back sizes its copies by q; anything
    else would read past the result or hang the ranks on mismatched
    collectives)."""
    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        o = attn(q, k, v)
        if not (isinstance(o, Tensor) and o.shape == q.shape and o.device == q.device):
            got = f"{o.shape} on {o.device}" if isinstance(o, Tensor) else type(o).__name__
            raise ValueError(f"ulysses: attn_fn must return a tensor shaped like its q, {q.shape} on {q.device}, "
                             f"got {got}")
        return o
    return run


def _chunked_attention(q: Tensor, k: Tensor, v: Tensor, group, attn: AttnFn, chunks: int, transport: str) -> Tensor:
    """The layer with its heads in ``chunks`` (checked: _checked_chunks), or
    over the copy engines; a wire_dtype never gets here (chunks=1 only)."""
    world, _ = _world(group)
    q, k, v = _unit_head_dim(q, k, v)
    rows, heads, dim = q.shape
    kv = k.shape[1]
    over_peers = transport == "copy_engine" and world > 1  # one rank has nothing to send
    plan = _plan(rows, heads, kv, world, chunks, transport if over_peers else "nccl")
    if over_peers:
        return _peer.attention(q, k, v, group, attn, plan)
    chunks = len(plan)  # equal chunks over NCCL
    local_q, split = heads // world, kv >= world
    chunk_q = local_q // chunks
    chunk_kv = world * (kv // world // chunks) if split else kv
    # chunk c: q heads d * local_q + c * chunk_q + [0, chunk_q) of every destination d
    send = _C._pack_qkv_gqa(q, k, v, world, chunks) if q.is_cuda else _pack_torch(q, k, v, world, chunks)
    out = torch.empty((rows, heads, dim), dtype=q.dtype, device=q.device)
    placed = out.view(rows, world, local_q, dim)
    recv = torch.empty_like(send) if world > 1 else send

    def exchange(src: Tensor, dst: Tensor):
        return dist.all_to_all_single(dst, src, group=group, async_op=True) if world > 1 else None

    inbound = [exchange(send[0], recv[0])]
    back, outbound = [], []
    for c in range(chunks):
        if c + 1 < chunks:  # the next chunk travels while this one is attended to
            inbound.append(exchange(send[c + 1], recv[c + 1]))
        if inbound[c] is not None:
            inbound[c].wait()
        ql, kl, vl = _unpack(recv[c], world * chunk_q, chunk_kv, dim, world)
        o = attn(ql, kl, vl).reshape(world, rows, chunk_q, dim).contiguous()  # [S, chunk_q, D] by source rank
        back.append(torch.empty_like(o) if world > 1 else o)
        outbound.append(exchange(o, back[c]))
    for c in range(chunks):
        if outbound[c] is not None:
            outbound[c].wait()
        placed[:, :, c * chunk_q:(c + 1) * chunk_q].copy_(back[c].permute(1, 0, 2, 3))
    return out


class UlyssesAttention(torch.nn.Module):
    """Module form of :func:`ulysses_attention`."""

    def __init__(self, group=None, attn_fn: Optional[AttnFn] = None, causal: bool = False, validate: bool = True,
                 chunks=1, wire_dtype=None, transport: str = "nccl"):
        super().__init__()
        self.group, self.attn_fn, self.causal, self.validate = group, attn_fn, causal, validate
        self.chunks, self.wire_dtype, self.transport = chunks, wire_dtype, transport

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return ulysses_attention(q, k, v, self.group, self.attn_fn, self.causal, self.validate, self.chunks,
                                 self.wire_dtype, self.transport)
