"""The layer on the models' shapes: ``[batch, rows, heads, head_dim]`` per rank,
each rank its own number of rows, any head count, an optional key-padding
mask. Rows are padded to the longest rank's and masked as keys, heads padded
to a multiple of the world size (k/v expanded to q's heads where the kv heads
cannot be split or replicated); the batch folds into the rows of the
three-dimensional layer, whose attention sees each sequence whole again."""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import _C
from .agreement import (
    AUTO_CHUNKS,
    _causal_code,
    _dtype_code,
    _every_rank,
    _local_chunks,
    _lse_code,
    _prologue_code,
    _refuse_grad,
    _require_same,
    _transport_code,
    _wire_code,
    _world,
)
from .exchange import _MERGE_DTYPES
from .prologue import send_side

Tensor = torch.Tensor
BatchedAttnFn = Callable[[Tensor, Tensor, Tensor, Optional[Tensor]], Tensor]

# What every rank tells the others (one agreement): "rows" may differ between ranks.
_BATCHED_FIELDS = (
    "q dims",
    "rows",
    "batch",
    "q heads",
    "kv heads",
    "head_dim",
    "dtype",
    "key_padding_mask",
    "chunks",
    "wire_dtype",
    "transport",
    "causal",
    "return_lse",
    "prologue",
)


def padded_heads(heads: int, kv: int, world: int) -> Tuple[int, int]:
    """(q heads, kv heads) as the exchange carries them: q heads padded with zero
    heads to a multiple of the world size; kv heads as given where they split
    across the ranks or divide the world size (and q needed no padding), else
    expanded to one per q head and padded alike."""
    if heads % world == 0 and (kv % world == 0 or world % kv == 0):
        return heads, kv
    padded = -(-heads // world) * world
    return padded, padded


def sdpa_batched(causal: bool = False, scale: Optional[float] = None) -> BatchedAttnFn:
    """Default attention of batched inputs: ``[B, S, h, D]`` q/k/v and a key
    mask ``[B, S]`` (True: attend; None: every key) -> ``[B, S, h, D]``, through
    torch's scaled_dot_product_attention; fewer k/v heads are repeated."""

    def attn(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor]) -> Tensor:
        if k.shape[2] != q.shape[2]:
            rep = q.shape[2] // k.shape[2]
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        if causal and mask is not None:
            s = q.shape[1]
            mask = mask & torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=causal and mask is None,
            scale=scale,
        )
        return out.transpose(1, 2)

    return attn


def _batched_fields(
    q, k, v, key_padding_mask, world: int, chunks, wire_dtype, transport, attn_fn, causal, return_lse, prologue=None
) -> list:
    """The batched layer's local checks, in order; returns its _BATCHED_FIELDS."""
    _C._check_ulysses_batched(q, k, v, key_padding_mask)  # the messages live in src/core, once
    _refuse_grad(q, k, v)
    heads, kv = padded_heads(q.shape[2], k.shape[2], world)
    count = _local_chunks(heads, kv, world, chunks)
    wire = _wire_code(wire_dtype, count)
    how = _transport_code(transport, q, wire_dtype)
    attention = _causal_code(attn_fn, causal)
    lse = _lse_code(return_lse, attn_fn, count, transport)
    rotation = _prologue_code(prologue)
    batch, rows, _, dim = q.shape
    return [4, rows, batch, q.shape[2], k.shape[2], dim, _dtype_code(q.dtype), int(key_padding_mask is not None)] + [
        count,
        wire,
        how,
        attention,
        lse,
        rotation,
    ]


def _fold(t: Tensor, rows: int, heads: int, expand: int = 1) -> Tensor:
    """``[B, S, h, D]`` -> ``[rows, B, heads, D]``, rows (s, b) as the exchange
    carries them (so that the receive buffer views as whole sequences): each
    head repeated ``expand`` times (kv heads expanded to q's), then rows and
    heads padded with zeros; a view where nothing is padded or expanded."""
    if expand > 1:
        t = t.repeat_interleave(expand, dim=2)
    batch, s, h, dim = t.shape
    if s == rows and h == heads:
        return t.transpose(0, 1)
    out = t.new_zeros(rows, batch, heads, dim)
    out[:s, :, :h] = t.transpose(0, 1)
    return out


def sequence_views(t: Tensor, world: int, batch: int) -> Tensor:
    """The exchange's ``[world * rows * B, h, D]`` (rows by source rank, then row, then batch; any row stride) as
    whole sequences ``[B, world * rows, h, D]``: a view, (rank, row) merging into one sequence dimension."""
    rows = t.shape[0] // (world * batch)
    return t.view(world, rows, batch, t.shape[1], t.shape[2]).permute(2, 0, 1, 3, 4).flatten(1, 2)


def _sequence_mask(valid: Tensor, group, world: int) -> Tensor:
    """Every rank's ``[B, rows]`` key validity -> the whole sequence's ``[B, world * rows]`` (rank order)."""
    mine = valid.to(torch.uint8).contiguous()
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    return torch.stack(every, dim=1).flatten(1, 2).to(torch.bool)


def batched_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Optional[Tensor],
    group,
    attn_fn: Optional[BatchedAttnFn],
    causal: bool,
    validate: bool,
    chunks,
    wire_dtype,
    transport: str,
    layer: Callable,
    return_lse: bool = False,
    rows_layer: Optional[Callable] = None,
    prologue: Optional[dict] = None,
    sent_layer: Optional[Callable] = None,
):
    """ulysses_attention on ``[B, S, H, D]`` inputs (``layer``: the three-dimensional one; ``rows_layer``: its
    CUDA NCCL one-chunk path on ``[rows, B, H, D]``, returning ``[B, rows, H, D]``; ``sent_layer``: its path from
    fp8 wire rows packed here); with return_lse, (out, lse) with lse ``[B, H, S]`` float32 for this rank's rows. A
    prologue runs inside the local checks, so that its errors reach every rank through the agreement."""
    world, _ = _world(group)
    sent = {}

    def local():
        fields = _batched_fields(
            q, k, v, key_padding_mask, world, chunks, wire_dtype, transport, attn_fn, causal, return_lse, prologue
        )
        if prologue is not None:
            unpadded = padded_heads(q.shape[2], k.shape[2], world) == (q.shape[2], k.shape[2])
            if wire_dtype is None:
                fused = rows_layer is not None and _rows_path(q, transport, chunks, wire_dtype, return_lse)
            else:
                fused = sent_layer is not None and _rows_path(q, transport, chunks, None, False)
            sent["q"], sent["k"], sent["send"] = send_side(q, k, v, prologue, world, unpadded and fused, wire_dtype)
        return fields

    if validate:
        every = _every_rank(group, _BATCHED_FIELDS, local)
        _require_same(_BATCHED_FIELDS, every, varying=("rows",))
        rows: List[int] = [e[1] for e in every]
    else:
        rows = [local()[1]] * world  # the caller promises that every rank holds as many rows
    send = sent.get("send")
    if prologue is not None:
        q, k = sent["q"], sent["k"]
    batch, s, heads, dim = q.shape
    longest = max(rows)
    ph, pkv = padded_heads(heads, k.shape[2], world)
    masked = key_padding_mask is not None or len(set(rows)) > 1
    key_mask = None
    if masked:
        valid = torch.zeros(batch, longest, dtype=torch.bool, device=q.device)
        valid[:, :s] = True if key_padding_mask is None else key_padding_mask
        key_mask = _sequence_mask(valid, group, world)
    attend = attn_fn or sdpa_batched(causal)

    def whole_sequences(ql: Tensor, kl: Tensor, vl: Tensor):
        """Attention on the layer's ``[world * rows * B, h, D]`` (rows by source
        rank, then row, then batch) as views ``[B, S, h, D]`` of it, each
        sequence whole; then back in that order (and with return_lse its
        ``[B, h, S]`` lse as the layer's ``[h, rows]``)."""

        h = ql.shape[1]
        views = (sequence_views(t, world, batch) for t in (ql, kl, vl))
        result = attend(*views, key_mask)
        out, lse = result if return_lse and isinstance(result, tuple) and len(result) == 2 else (result, None)
        if not (isinstance(out, Tensor) and out.shape == (batch, world * longest, h, dim)):
            return result  # the layer reports it, with its message
        out = out.view(batch, world, longest, h, dim).permute(1, 2, 0, 3, 4).reshape(ql.shape)
        if not return_lse:
            return out
        if not (isinstance(lse, Tensor) and lse.shape == (batch, h, world * longest)):
            return out, lse  # likewise
        return out, lse.view(batch, h, world, longest).permute(1, 2, 3, 0).reshape(h, -1)

    if send is not None:  # the prologue's fused pass packed q, k and v: [world, s, batch, row]
        if longest > s:  # zero rows (a zero wire row dequantizes to zeros)
            padded = send.new_zeros(world, longest, batch, send.shape[3])
            padded[:, :s] = send
            send = padded
        if wire_dtype is None:
            t = (x.transpose(0, 1) for x in (q, k, v))
            return rows_layer(*t, group, whole_sequences, send)[:, :s, :heads]
        sent_rows = send.view(world, longest * batch, send.shape[3])
        got = sent_layer(sent_rows, heads, k.shape[2], dim, q.dtype, group, whole_sequences, wire_dtype, return_lse)
    else:
        expand = heads // k.shape[2] if pkv != k.shape[2] else 1
        q4, k4, v4 = _fold(q, longest, ph), _fold(k, longest, pkv, expand), _fold(v, longest, pkv, expand)
        if rows_layer is not None and _rows_path(q, transport, chunks, wire_dtype, return_lse):
            return rows_layer(q4, k4, v4, group, whole_sequences)[:, :s, :heads]
        q3, k3, v3 = (t.reshape(longest * batch, t.shape[2], dim) for t in (q4, k4, v4))
        got = layer(q3, k3, v3, group, whole_sequences, causal, False, chunks, wire_dtype, transport, None, return_lse)
    out = got[0] if return_lse else got
    out = out.view(longest, batch, ph, dim).transpose(0, 1)[:, :s, :heads]
    if not return_lse:
        return out
    return out, got[1].view(ph, longest, batch).permute(2, 0, 1)[:, :heads, :s]


def _rows_path(q: Tensor, transport: str, chunks, wire_dtype, return_lse: bool) -> bool:
    """Whether the pack reads the ``[rows, B, H, D]`` views itself: CUDA, NCCL, one chunk, no fp8 wire, no lse, a
    dtype usp_merge_heads takes. Elsewhere ``B > 1`` rows are regrouped on the sender (one copy, with any padding)."""
    one_chunk = chunks == 1 or (chunks == "auto" and AUTO_CHUNKS == 1)
    plain = wire_dtype is None and not return_lse and q.dtype in _MERGE_DTYPES
    return q.is_cuda and transport == "nccl" and one_chunk and plain
