"""The attention layer: scatter, attention over the whole sequence with the
rank's share of the heads, gather; whole or in head chunks that overlap the
exchanges with attention, over NCCL or the copy engines."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import _C, _peer
from ..usp_merge_heads import usp_merge_heads
from .agreement import _AUTO_FIELD, AUTO_CHUNKS, _checked_chunks, _plan, _world
from .batched import batched_attention
from .exchange import _exchange, _pack_torch, _scatter, _scatter_sent, _unit_head_dim, _unpack, gather_heads

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
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=causal, scale=scale
        )
        return out[0].transpose(0, 1)

    return attn


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group=None,
    attn_fn: Optional[AttnFn] = None,
    causal: bool = False,
    validate: bool = True,
    chunks=1,
    wire_dtype=None,
    transport: str = "nccl",
    key_padding_mask: Optional[Tensor] = None,
    return_lse: bool = False,
    prologue: Optional[dict] = None,
):
    """Attention over the whole sequence for this rank's shard of it.

    One exchange in (q, k, v packed together), attention over the whole
    sequence with this rank's share of the heads, one exchange back. The
    result equals attention over the whole sequence on one device, sliced to
    the rank's rows.

    Parameters
    ----------
    q : torch.Tensor
        ``[rows, H, D]``: this rank's rows of the sequence (rank order); or
        batched ``[B, rows, H, D]`` (the models' shape, strided views
        included), where each rank may hold its own number of rows and ``H``
        need not divide by the world size (padded; masked in attention).
    k, v : torch.Tensor
        ``[rows, H_kv, D]`` (``[B, rows, H_kv, D]``); ``H_kv`` divides ``H``
        and, for 3-D inputs, is a multiple of the world size or divides it
        (then each rank gets the kv head its q heads use).
    group : torch.distributed.ProcessGroup, optional
        The ranks (default: the world).
    attn_fn : callable, optional
        ``attn_fn(q, k, v)`` on ``[S, h, D]`` tensors, returning ``[S, h, D]``
        (default: :func:`sdpa` with ``causal``); for batched inputs
        ``attn_fn(q, k, v, key_mask)`` on ``[B, S, h, D]`` tensors with a
        ``[B, S]`` bool key mask (True: attend) or None (default:
        :func:`sdpa_batched`).
    causal : bool
        For the default attention.
    validate : bool
        The ranks agree on geometry, dtype and options first (one small
        all_gather), so that a bad input on any rank raises the same error on
        every rank; pass False inside CUDA-graph capture.
    chunks : int or "auto"
        Split each rank's heads into groups whose exchanges overlap attention
        on the previous group.
    wire_dtype : torch.dtype, optional
        ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``: both exchanges in
        fp8 with a scale per row and head.
    transport : str
        ``"nccl"`` or ``"copy_engine"`` (one node, peer access).
    key_padding_mask : torch.Tensor, optional
        Batched inputs only: ``[B, rows]`` bool, True for this rank's keys
        that take part in attention.
    return_lse : bool
        ``attn_fn`` returns ``(out, lse)`` (lse: float32 ``[h, S]``, batched
        ``[B, h, S]``), and so does the layer, with the lse of this rank's
        rows and every head, for combining with ring attention; needs an
        ``attn_fn``, ``chunks=1`` and ``transport="nccl"``.
    prologue : dict, optional
        Batched inputs only: keyword arguments of :func:`attnprep.qk_norm_rope`
        (``positions`` among them; not ``inplace`` or ``q_scale``): the layer
        sends ``qk_norm_rope(q, k, **prologue)`` in place of q and k, normed,
        rotated and packed by one kernel where it can (CUDA).

    Returns
    -------
    torch.Tensor or tuple
        ``[rows, H, D]`` (``[B, rows, H, D]``, a view of the layer's output
        buffer), q's dtype and device; with ``return_lse``, ``(out, lse)``,
        lse float32 ``[H, rows]`` (``[B, H, rows]``).

    Raises
    ------
    TypeError, ValueError
        The messages of the contract (``contract.md`` in the package), the
        same on every rank.

    Examples
    --------
    On each of the ranks of an initialized process group:

    >>> out = ulysses_attention(q, k, v, causal=True)  # doctest: +SKIP
    """
    if isinstance(q, Tensor) and q.dim() == 4:
        options = (key_padding_mask, group, attn_fn, causal, validate, chunks, wire_dtype, transport)
        paths = dict(layer=_attention, rows_layer=_attention_rows, sent_layer=_attention_sent)
        return batched_attention(q, k, v, *options, return_lse=return_lse, prologue=prologue, **paths)
    return _attention(
        q, k, v, group, attn_fn, causal, validate, chunks, wire_dtype, transport, key_padding_mask, return_lse, prologue
    )


def _attention(
    q,
    k,
    v,
    group,
    attn_fn,
    causal,
    validate,
    chunks,
    wire_dtype,
    transport,
    key_padding_mask=None,
    return_lse=False,
    prologue=None,
):
    """The layer on ``[rows, heads, D]`` inputs."""
    chunks = _checked_chunks(
        q, k, v, group, validate, chunks, wire_dtype, transport, attn_fn, causal, key_padding_mask, return_lse, prologue
    )
    if return_lse:  # (checked: an attn_fn, one chunk, NCCL)
        ql, kl, vl = _scatter(q, k, v, group, False, wire_dtype)
        o, lse = _checked_lse(attn_fn)(ql, kl, vl)
        return gather_heads(o, group, wire_dtype=wire_dtype, validate=False), _lse_to_rows(lse, group)
    attn = _checked(attn_fn or sdpa(causal))
    if transport == "nccl" and (chunks == 1 or (chunks == _AUTO_FIELD and AUTO_CHUNKS == 1)):
        ql, kl, vl = _scatter(q, k, v, group, False, wire_dtype)
        return gather_heads(attn(ql, kl, vl), group, wire_dtype=wire_dtype, validate=False)  # attn's result is checked
    return _chunked_attention(q, k, v, group, attn, chunks, transport)


def _attention_rows(q: Tensor, k: Tensor, v: Tensor, group, attn: AttnFn, send: Optional[Tensor] = None) -> Tensor:
    """The batched layer's CUDA NCCL one-chunk path (checked by it): ``[rows, B, H, D]`` views packed as they lie
    (rows (s, b)), or the prologue's ``send`` ``[world, rows, B, n * D]`` (its rows may outnumber q's: padded),
    ``attn`` on the receive buffer's views, and the way back merged straight into ``[B, rows, H, D]``."""
    world, _ = _world(group)
    _, batch, heads, dim = q.shape
    if send is None:
        q, k, v = _unit_head_dim(q, k, v)
        send = _C._pack_qkv_gqa(q, k, v, world, 1)[0]
    rows = send[0].numel() // (batch * send.shape[-1])
    _, recv = _exchange(send.view(world, rows * batch, send.shape[-1]), group, world, False)
    o = _checked(attn)(*_unpack(recv, heads, k.shape[2], dim, world))
    _, back = _exchange(o.view(world, rows * batch, heads // world, dim).contiguous(), group, world, False)
    return usp_merge_heads(back.view(world, rows, batch, heads // world, dim)).view(batch, rows, heads, dim)


def _attention_sent(sent: Tensor, heads: int, kv: int, dim: int, dtype, group, attn, wire_dtype, return_lse: bool):
    """The three-dimensional layer's NCCL one-chunk path from fp8 wire rows ``[W, rows, row_bytes]`` that the
    batched layer's fused prologue packed (checked by it): as _attention from its exchange on."""
    ql, kl, vl = _scatter_sent(sent, heads, kv, dim, dtype, group, wire_dtype)
    if return_lse:
        o, lse = _checked_lse(attn)(ql, kl, vl)
        return gather_heads(o, group, wire_dtype=wire_dtype, validate=False), _lse_to_rows(lse, group)
    return gather_heads(_checked(attn)(ql, kl, vl), group, wire_dtype=wire_dtype, validate=False)


def _checked_lse(attn: Callable):
    """attn returning (out, lse), both checked before anything reads them, as _checked checks out: lse float32
    ``[h, S]`` on q's device."""

    def run(q: Tensor, k: Tensor, v: Tensor):
        result = attn(q, k, v)
        ok = isinstance(result, tuple) and len(result) == 2 and all(isinstance(t, Tensor) for t in result)
        o, lse = result if ok else (None, None)
        want = (q.shape[1], q.shape[0])
        if not (
            ok
            and o.shape == q.shape
            and o.device == q.device
            and lse.shape == want
            and lse.dtype == torch.float32
            and lse.device == q.device
        ):
            if ok:
                got = f"({o.shape}, {lse.dtype} {lse.shape}) on {o.device}"
            else:
                got = f"a tensor {result.shape}" if isinstance(result, Tensor) else type(result).__name__
            raise ValueError(
                f"ulysses: with return_lse=True, attn_fn must return (out, lse): out shaped like its q, {q.shape}, "
                f"and lse float32 [{want[0]}, {want[1]}], on {q.device}, got {got}"
            )
        return o, lse

    return run


def _lse_to_rows(lse: Tensor, group) -> Tensor:
    """The rank's ``[h, world * rows]`` lse (its heads, every rank's rows) -> ``[world * h, rows]`` (every head,
    its rows): one all_to_all, heads in rank order as the exchange deals them."""
    world, _ = _world(group)
    h, total = lse.shape
    rows = total // world
    send = lse.view(h, world, rows).transpose(0, 1).contiguous()
    if world == 1:
        return send.view(h, rows)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.view(world * h, rows)


def _checked(attn: AttnFn) -> AttnFn:
    """attn, its result checked before anything reads it: a tensor of its q's
    shape on q's device (the exchange back sizes its copies by q; anything
    else would read past the result or hang the ranks on mismatched
    collectives)."""

    def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        o = attn(q, k, v)
        if not (isinstance(o, Tensor) and o.shape == q.shape and o.device == q.device):
            got = f"{o.shape} on {o.device}" if isinstance(o, Tensor) else type(o).__name__
            raise ValueError(
                f"ulysses: attn_fn must return a tensor shaped like its q, {q.shape} on {q.device}, got {got}"
            )
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
        placed[:, :, c * chunk_q : (c + 1) * chunk_q].copy_(back[c].permute(1, 0, 2, 3))
    return out


class UlyssesAttention(torch.nn.Module):
    """Module form of :func:`ulysses_attention`."""

    def __init__(
        self,
        group=None,
        attn_fn: Optional[AttnFn] = None,
        causal: bool = False,
        validate: bool = True,
        chunks=1,
        wire_dtype=None,
        transport: str = "nccl",
        return_lse: bool = False,
    ):
        super().__init__()
        self.group, self.attn_fn, self.causal, self.validate = group, attn_fn, causal, validate
        self.chunks, self.wire_dtype, self.transport, self.return_lse = chunks, wire_dtype, transport, return_lse

    def forward(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor] = None, prologue=None):
        return ulysses_attention(
            q,
            k,
            v,
            self.group,
            self.attn_fn,
            self.causal,
            self.validate,
            self.chunks,
            self.wire_dtype,
            self.transport,
            key_padding_mask,
            self.return_lse,
            prologue,
        )
