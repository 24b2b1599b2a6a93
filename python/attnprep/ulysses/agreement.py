"""The ranks' agreement before any data moves.

Every rank runs its local checks and sends its geometry (or the verdict of
its checks, with the message) in one small all_gather, so that a bad input
on any rank, or ranks that disagree, make every rank raise the same error
and none waits in a collective (docs/contract.md lists the messages).
"""

from __future__ import annotations

import zlib
from typing import Callable, Tuple

import torch
import torch.distributed as dist

from .. import _C, _peer

Tensor = torch.Tensor


def _world(group) -> Tuple[int, int]:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"ulysses: group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    return dist.get_world_size(group), dist.get_rank(group)


def _check_geometry(q: Tensor, k: Tensor, v: Tensor, world: int) -> None:
    _C._check_ulysses_geometry(q, k, v, world)  # the messages live in src/core, once


INFERENCE_ONLY = "ulysses: the layer is inference-only; q, k and v must not require grad (use torch.no_grad())"


def _refuse_grad(q: Tensor, k: Tensor, v: Tensor) -> None:
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise ValueError(INFERENCE_ONLY)


def _check_local(q: Tensor, k: Tensor, v: Tensor, world: int) -> None:
    _check_geometry(q, k, v, world)
    _refuse_grad(q, k, v)


# What every rank tells the others before any data moves: its geometry, then
# the verdict of its local checks (0: passed, 1: ValueError, 2: TypeError)
# with the message as UTF-8 bytes, one per int64.
_FIELDS = (
    "q dims",
    "rows",
    "q heads",
    "kv heads",
    "head_dim",
    "dtype",
    "chunks",
    "wire_dtype",
    "transport",
    "causal",
    "return_lse",
)


_WIRE = {None: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


_TRANSPORTS = {"nccl": 0, "copy_engine": 1}


_MESSAGE_BYTES = 240
# Every description has room for this many fields, so that ranks that take
# different paths (3-D and batched inputs) still gather tensors of one size.
_MAX_FIELDS = 16


# A dtype as the agreement sends it: the CRC-32 of its name, the same in every process and torch release and
# distinct for each of torch's dtypes (tests/python/test_ulysses.py), so ranks with different dtypes never agree.
_DTYPE_CODES = {zlib.crc32(str(d).encode()): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


# chunks="auto" over NCCL does not split: on two H200s every measured shape ran slower chunked (NCCL's kernels
# slow attention by more than the split hides; bench/README.md). Over the copy engines it is _peer.auto_plan.
AUTO_CHUNKS = 1


# "auto" in the agreement's chunks field (a count is positive)
_AUTO_FIELD = 0


def _saturated(n: int) -> int:
    """A count for the C++ checks (int64 arguments): one past int64 fails
    them as any count above the heads does."""
    return max(-(2**62), min(n, 2**62))


def _local_chunks(heads: int, kv: int, world: int, chunks) -> int:
    """The chunk count checked against this rank's heads: a positive int, or
    _AUTO_FIELD for "auto"."""
    local_q, split = heads // world, kv >= world
    local_kv = kv // world if split else 1
    if isinstance(chunks, str) and chunks == "auto":
        return _AUTO_FIELD
    if isinstance(chunks, bool) or not isinstance(chunks, int):
        raise TypeError(f'ulysses: chunks must be an int or "auto", got {type(chunks).__name__}')
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
        raise ValueError('ulysses: transport must be "nccl" or "copy_engine"')
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


LSE_NEEDS_ATTN_FN = "ulysses: return_lse=True needs an attn_fn that returns (out, lse)"
LSE_NEEDS_ONE_CHUNK = 'ulysses: return_lse=True needs chunks=1 and transport="nccl"'


def _lse_code(return_lse, attn_fn, chunks: int, transport) -> int:
    """return_lse a bool; with it, an attn_fn of the caller's, one chunk and the NCCL (or gloo) path."""
    if not isinstance(return_lse, bool):
        raise TypeError(f"ulysses: return_lse must be a bool, got {type(return_lse).__name__}")
    if return_lse and attn_fn is None:
        raise ValueError(LSE_NEEDS_ATTN_FN)
    if return_lse and (chunks != 1 or transport != "nccl"):
        raise ValueError(LSE_NEEDS_ONE_CHUNK)
    return int(return_lse)


def _dtype_code(dtype) -> int:
    return zlib.crc32(str(dtype).encode())


def _describe(fields: Tuple[str, ...], local: Callable[[], list]) -> Tensor:
    """What this rank tells the others: the values of ``fields`` that
    ``local()`` returns after this rank's local checks, or the verdict of
    those checks with the message."""
    n = len(fields)
    info = torch.zeros(_MAX_FIELDS + 1 + _MESSAGE_BYTES, dtype=torch.int64)
    try:
        info[:n] = torch.tensor(local())
    except (ValueError, TypeError) as e:
        info[_MAX_FIELDS] = 1 if isinstance(e, ValueError) else 2
        text = str(e).encode()[:_MESSAGE_BYTES]
        info[_MAX_FIELDS + 1 : _MAX_FIELDS + 1 + len(text)] = torch.tensor(list(text), dtype=torch.int64)
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
    if field in ("causal", "key_padding_mask", "return_lse", "prologue"):
        return bool(x)
    return x


VALIDATE_IN_CAPTURE = (
    "ulysses: validate=True cannot run inside CUDA-graph capture (the ranks agree through a "
    "collective whose result the host reads); make one call with validate=True before capturing "
    "and pass validate=False inside the capture"
)


def _every_rank(group, fields: Tuple[str, ...], local: Callable[[], list]) -> list:
    """One all_gather of each rank's _describe: every rank's values of ``fields``,
    after raising (on every rank alike) the error of the lowest rank whose local
    checks failed."""
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
        verdict = int(info[_MAX_FIELDS])
        if verdict:
            text = bytes(int(b) for b in info[_MAX_FIELDS + 1 :] if b).decode(errors="replace")
            raise (ValueError if verdict == 1 else TypeError)(f"ulysses: rank {rank}: {text}")
    return [[int(x) for x in t[:n]] for t in every]


def _require_same(fields: Tuple[str, ...], every: list, varying: Tuple[str, ...] = ()) -> None:
    """Every rank's values of each field but ``varying`` must be the same. ``fields`` starts with "rows"."""
    for i, field in enumerate(fields):
        values = [e[i] for e in every]
        if field in varying or len(set(values)) == 1:
            continue
        if field == "rows":
            raise ValueError(f"ulysses: every rank must hold the same number of rows, got {values}")
        shown = "[" + ", ".join(str(_shown(field, x)) for x in values) + "]"
        raise ValueError(f"ulysses: every rank must pass the same {field}, got {shown}")


def _agree_on(group, fields: Tuple[str, ...], local: Callable[[], list]) -> list:
    """Every rank raises the same error, or none does: one all_gather of each
    rank's _describe; returns the values every rank agreed on."""
    every = _every_rank(group, fields, local)
    _require_same(fields, every)
    return every[0]


MASK_NEEDS_BATCH = "ulysses: key_padding_mask needs batched [batch, rows, heads, head_dim] inputs"
PROLOGUE_NEEDS_BATCH = "ulysses: prologue needs batched [batch, rows, heads, head_dim] inputs"

# qk_norm_rope's arguments a prologue may hold (inplace and q_scale would change what the layer is handed: not taken)
PROLOGUE_KEYS = (
    "positions",
    "cos_sin_cache",
    "rope_base",
    "rotary_dim",
    "is_neox",
    "q_norm_weight",
    "k_norm_weight",
    "norm_eps",
    "norm_weight_offset",
    "mrope_section",
    "mrope_interleaved",
)


def _prologue_code(prologue) -> int:
    """A prologue is None or a dict of PROLOGUE_KEYS and text_norm (the values are checked where they are used)."""
    if prologue is None:
        return 0
    if not isinstance(prologue, dict):
        raise TypeError(f"ulysses: prologue must be a dict or None, got {type(prologue).__name__}")
    for key in prologue:
        if key not in PROLOGUE_KEYS and key != "text_norm":
            keys = ", ".join(PROLOGUE_KEYS)
            raise TypeError(f"ulysses: prologue takes qk_norm_rope's {keys} and text_norm, got {key!r}")
    return 1


def _layer_fields(
    q,
    k,
    v,
    world: int,
    chunks=1,
    wire_dtype=None,
    transport="nccl",
    attn_fn=None,
    causal=False,
    key_padding_mask=None,
    return_lse=False,
    prologue=None,
) -> list:
    """The layer's (and scatter_heads') local checks, in order; returns its _FIELDS."""
    _check_local(q, k, v, world)
    count = _local_chunks(q.shape[1], k.shape[1], world, chunks)
    wire = _wire_code(wire_dtype, count)
    how = _transport_code(transport, q, wire_dtype)
    attention = _causal_code(attn_fn, causal)
    if key_padding_mask is not None:
        raise ValueError(MASK_NEEDS_BATCH)
    lse = _lse_code(return_lse, attn_fn, count, transport)
    if _prologue_code(prologue):
        raise ValueError(PROLOGUE_NEEDS_BATCH)
    return [3, q.shape[0], q.shape[1], k.shape[1], q.shape[2], _dtype_code(q.dtype), count, wire, how, attention, lse]


def _checked_chunks(q, k, v, group, validate: bool, *args) -> int:
    """The local checks (``validate``: and the agreement) of _layer_fields'
    arguments after q, k, v; returns the chunk count (_AUTO_FIELD for "auto")."""
    world, _ = _world(group)
    fields = (
        _agree_on(group, _FIELDS, lambda: _layer_fields(q, k, v, world, *args))
        if validate
        else _layer_fields(q, k, v, world, *args)
    )
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
