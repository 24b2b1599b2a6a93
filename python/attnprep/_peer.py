"""The Ulysses layer's copy-engine transport (``transport="copy_engine"``,
docs/contract.md).

NCCL's all_to_all runs kernels: beside attention, which fills every
multiprocessor, they wait for SMs (a kernel launched behind attention gets
none until attention's last wave) and slow attention down when they get
them. Here nothing the exchange does needs an SM:

- each rank copies its q, k, v heads for rank d straight from q, k, v into
  d's receive buffer (one 2-D cudaMemcpyAsync per tensor: rows of a head
  range; no pack pass), on a side stream: the GPU's copy engines move them;
- it then writes a flag in d's memory (a stream memory operation, after a
  fence); d's compute stream waits for that flag before attention on the
  chunk, and when attention is done writes a flag back into the sender's
  memory saying the buffer may be written again. Waiting for and writing
  32-bit words happens in the stream's front end, without a kernel;
- the way back likewise: each chunk's attention output goes, as it is
  finished, straight into its owner's output buffer ``[rows, heads, D]``.

The flags are credits, not counters: every call leaves them as it found them,
so a captured CUDA graph replays the protocol unchanged.

Receive buffers and flags are allocated once per (group, shape, chunks,
dtype, device) and opened by every other rank through CUDA IPC on the
shape's first call (a collective; not inside CUDA-graph capture). They are
kept for the life of the process (a peer's mapping must not outlive the
memory behind it). Each rank opens its peers' buffers with its own GPU
current: the copies then run at NVLink speed (src/bindings/peer.cpp).

A rank that stops half-way through a call on its own (a killed process, an
``attn_fn`` that fails on that rank only) leaves its peers' streams waiting
for its flags; the layer's checks run on every rank before anything is
sent, so bad input fails everywhere alike first, and an ``attn_fn`` that
raises on every rank leaves the flags as a call leaves them.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _C

NEEDS = 'ulysses: transport="copy_engine" needs CUDA tensors and wire_dtype=None'
SET_UP_FIRST = (
    'ulysses: transport="copy_engine" sets up its buffers on a shape\'s first call; make one call before capturing'
)

# the flag arrays, [4, chunks, world] int32 per rank: flag[kind, c, s] concerns chunk c and peer s
READY_IN, FREE_IN, READY_BACK, FREE_BACK = range(4)


def no_peer_access(rank: int, why: str) -> str:
    return f'ulysses: transport="copy_engine" needs every rank\'s GPU on one node with peer access (rank {rank}: {why})'


# A peer allocation is opened once per process and device: two buffers may
# share one allocation of the peer's caching allocator.
_OPENED: Dict[Tuple[bytes, int], int] = {}


def _open(handle: bytes, device: int) -> int:
    key = (handle, device)
    if key not in _OPENED:
        _OPENED[key] = _C._ipc_open(handle, device)
    return _OPENED[key]


def open_peers(group, tensors: List[Tensor]) -> List[List[int]]:
    """For each of this rank's ``tensors`` (one per buffer, the same list on
    every rank), every rank's copy's device address as this process sees it:
    ``[buffer][rank]``. A collective; every rank raises the same ValueError
    when some rank cannot open some peer's memory."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = tensors[0].device.index
    torch.cuda.synchronize(device)  # the buffers' initial contents are in place before peers may write
    offers: List = [None] * world
    dist.all_gather_object(offers, (device, [_C._ipc_export(t.data_ptr(), device) for t in tensors]), group=group)
    addr = [[0] * world for _ in tensors]
    why = ""
    try:
        for r, (peer_device, exported) in enumerate(offers):
            if r != rank and not _C._peer_access(device, peer_device):
                raise RuntimeError(f"GPU {device} cannot access GPU {peer_device}")
            for i, (handle, offset) in enumerate(exported):
                addr[i][r] = tensors[i].data_ptr() if r == rank else _open(handle, device) + offset
    except Exception as e:  # noqa: BLE001 (any failure to open a peer means the transport cannot run)
        why = str(e) or type(e).__name__
    verdicts: List = [None] * world
    dist.all_gather_object(verdicts, why, group=group)
    for r, text in enumerate(verdicts):
        if text:
            raise ValueError(no_peer_access(r, text))
    return addr


class Mailbox:
    """One rank's receive side for one layer shape: ``inbox`` (per chunk: q,
    then k, then v, each ``[world * rows, heads, D]`` by source rank, what
    attention reads), ``outbox`` (``[rows, heads, D]``: the layer's output,
    written by every rank), and the flags; with every rank's addresses of
    all three."""

    def __init__(self, group, inbox_numel: int, chunks: int, out_shape: Tuple[int, ...], dtype, device):
        self.world, self.rank, self.chunks = dist.get_world_size(group), dist.get_rank(group), chunks
        self.inbox = torch.empty(inbox_numel, dtype=dtype, device=device)
        self.outbox = torch.empty(out_shape, dtype=dtype, device=device)
        self.flags = torch.zeros(4, chunks, self.world, dtype=torch.int32, device=device)
        self.flags[FREE_IN] = 1
        self.flags[FREE_BACK] = 1
        self.inbox_at, self.outbox_at, self.flags_at = open_peers(group, [self.inbox, self.outbox, self.flags])

    def flag(self, owner: int, kind: int, chunk: int, peer: int) -> int:
        """The address of rank ``owner``'s flag[kind, chunk, peer]."""
        return self.flags_at[owner] + ((kind * self.chunks + chunk) * self.world + peer) * 4


_BOXES: Dict[tuple, Mailbox] = {}
_STREAMS: Dict[Tuple[int, str], torch.cuda.Stream] = {}


def _stream(device: torch.device, role: str, priority: int = -1) -> torch.cuda.Stream:
    """One stream per device and role: "in" and "out" carry the copies to
    peers, "own" this rank's own blocks (high priority: should the driver
    carry out a same-GPU copy with a kernel, its blocks go ahead of
    attention's waiting ones); "attend" runs every other
    chunk's attention, so that a chunk's first blocks fill the SMs that the
    previous chunk's last blocks leave idle."""
    if (device.index, role) not in _STREAMS:
        _STREAMS[device.index, role] = torch.cuda.Stream(device, priority=priority)
    return _STREAMS[device.index, role]


def _rows_2d(t: Tensor) -> Tensor:
    """t ``[rows, heads, D]`` with each row's heads adjacent (one 2-D copy takes a head range of every row)."""
    return t if t.shape[1] <= 1 or t.stride(1) == t.shape[2] else t.contiguous()


def equal_plan(local_q: int, chunks: int) -> Tuple[int, ...]:
    """``chunks`` groups of equally many q heads (the count checked already)."""
    return (local_q // chunks,) * chunks


def growing_plan(local_q: int, group: int, ratio: float) -> Tuple[int, ...]:
    """Chunks that grow by ``ratio`` from a first chunk of one kv group
    (``group`` q heads share a kv head), with a last chunk of one kv group:
    attention on a chunk takes about ``ratio`` times as long as the inbound
    copies of as many heads, so each chunk's copies finish under attention
    on the chunk before it and only the first chunk's copies come before
    attention; only the last chunk's outbound copies follow it. A remainder
    smaller than the chunk before it joins that chunk. With ``ratio`` < 1
    attention cannot cover any copies: one chunk."""
    units = local_q // group
    if units < 3 or ratio < 1:
        return (local_q,)
    sizes, left = [1], units - 2
    while left:
        take = min(left, max(1, int(sizes[-1] * ratio)))
        if left - take < take:
            take = left
        sizes.append(take)
        left -= take
    return tuple(n * group for n in sizes + [1])


# chunks="auto" over the copy engines: attention on one head of S rows takes about S * AUTO_RATIO_PER_ROW times the
# copy engines' time for its q, k, v (two H200s, causal bf16 SDPA, head_dim 128: ratio 3.1 at S = 16384, 23 at
# 83968; bench/README.md). Non-causal attention takes twice as long, so the ratio errs towards smaller chunks.
AUTO_RATIO_PER_ROW = 2e-4


def auto_plan(local_q: int, local_kv: int, split: bool, sequence: int) -> Tuple[int, ...]:
    return growing_plan(local_q, local_q // local_kv if split else 1, sequence * AUTO_RATIO_PER_ROW)


def attention(q: Tensor, k: Tensor, v: Tensor, group, attn: Callable, plan: Tuple[int, ...]) -> Tensor:
    """The Ulysses layer over the copy engines (see the module docstring);
    the checks have passed on every rank. ``plan``: each chunk's number of
    q heads of a destination's ``local_q``, in order (a multiple of the q
    heads per kv head when kv heads are split). Chunk c of destination d:
    q heads d * local_q + first[c] + [0, plan[c]), kv heads likewise
    (split) or kv head d * kv / world (replicated)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows, heads, dim = q.shape
    kv = k.shape[1]
    device, elt = q.device, q.element_size()
    dev = device.index
    local_q, split = heads // world, kv >= world
    per_kv = local_q // (kv // world) if split else local_q
    chunks = len(plan)
    first_q = [sum(plan[:c]) for c in range(chunks)]
    n_q = [world * rows * h * dim for h in plan]
    n_kv = [world * rows * (h // per_kv if split else 1) * dim for h in plan]
    start = [sum(n_q[j] + 2 * n_kv[j] for j in range(c)) for c in range(chunks + 1)]
    key = (id(group), rows, heads, kv, dim, tuple(plan), q.dtype, dev)
    if key not in _BOXES:
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(SET_UP_FIRST)
        _BOXES[key] = Mailbox(group, start[chunks], chunks, (rows, heads, dim), q.dtype, device)
    box = _BOXES[key]
    q, k, v = _rows_2d(q), _rows_2d(k), _rows_2d(v)
    compute = torch.cuda.current_stream(device)
    inbound, outbound, own = _stream(device, "in"), _stream(device, "out"), _stream(device, "own")
    attend = [compute, _stream(device, "attend", 0)]
    peers = [d for d in range(world) if d != rank]

    def copy_rows(dst: int, dpitch: int, src: Tensor, head: int, n: int):
        """rows x heads [head, head + n) of src (all D) to dst, rows dpitch bytes apart."""
        _C._peer_copy_2d(
            dst, dpitch, src.data_ptr() + head * src.stride(1) * elt, src.stride(0) * elt, n * dim * elt, rows, dev
        )

    def send_in(c: int) -> torch.cuda.Event:
        """Chunk c of q, k, v to every rank: the peers' blocks on the inbound
        stream, this rank's own block beside them on the own-block stream (a
        same-GPU copy may take SMs and wait for them; it does not hold up the
        peers' copies). Returns the own block's event."""
        for d in peers + [rank]:
            with torch.cuda.stream(inbound if d != rank else own):
                if d != rank:  # d has read the previous call's chunk c
                    _C._stream_wait(box.flag(rank, FREE_IN, c, d), 1, dev)
                    _C._stream_write(box.flag(rank, FREE_IN, c, d), 0, dev)
                at = box.inbox_at[d] + start[c] * elt
                chunk_q = plan[c]
                chunk_kv = chunk_q // per_kv if split else 1
                kv_head = d * (kv // world) + first_q[c] // per_kv if split else d * kv // world
                copy_rows(
                    at + rank * rows * chunk_q * dim * elt, chunk_q * dim * elt, q, d * local_q + first_q[c], chunk_q
                )
                copy_rows(
                    at + (n_q[c] + rank * rows * chunk_kv * dim) * elt, chunk_kv * dim * elt, k, kv_head, chunk_kv
                )
                copy_rows(
                    at + (n_q[c] + n_kv[c] + rank * rows * chunk_kv * dim) * elt,
                    chunk_kv * dim * elt,
                    v,
                    kv_head,
                    chunk_kv,
                )
                if d != rank:
                    _C._stream_write(box.flag(d, READY_IN, c, rank), 1, dev)
        done = torch.cuda.Event()
        done.record(own)
        return done

    def send_back(c: int, o: Tensor, attended: torch.cuda.Stream):
        """Chunk c's attention output (computed on `attended`), rows of
        source d, into d's outbox; this rank's rows on the own-block stream."""
        for s in (outbound, own):
            s.wait_stream(attended)
            o.record_stream(s)
        for d in peers + [rank]:
            with torch.cuda.stream(outbound if d != rank else own):
                if d != rank:  # d has taken the previous call's output out of its outbox
                    _C._stream_wait(box.flag(rank, FREE_BACK, c, d), 1, dev)
                    _C._stream_write(box.flag(rank, FREE_BACK, c, d), 0, dev)
                _C._peer_copy_2d(
                    box.outbox_at[d] + (rank * local_q + first_q[c]) * dim * elt,
                    heads * dim * elt,
                    o.data_ptr() + d * rows * o.stride(0) * elt,
                    o.stride(0) * elt,
                    plan[c] * dim * elt,
                    rows,
                    dev,
                )
                if d != rank:
                    _C._stream_write(box.flag(d, READY_BACK, c, rank), 1, dev)

    # q, k, v are written, and this rank's reads of its boxes in its last call are done
    for s in [inbound, outbound, own, attend[1]]:
        s.wait_stream(compute)
    for t in (q, k, v):
        t.record_stream(inbound)
        t.record_stream(own)

    def collect(sent: int, copy: bool) -> Tensor:
        """On the compute stream: wait for the first `sent` chunks of every
        peer's output, copy the output out (when `copy`), then tell the peers
        that the outbox may be written again."""
        for s in (inbound, outbound, own, attend[1]):  # every side stream joined (a graph capture requires it)
            compute.wait_stream(s)
        for c in range(sent):
            for s in peers:
                _C._stream_wait(box.flag(rank, READY_BACK, c, s), 1, dev)
                _C._stream_write(box.flag(rank, READY_BACK, c, s), 0, dev)
        out = box.outbox.clone() if copy else box.outbox
        for c in range(sent):
            for s in peers:
                _C._stream_write(box.flag(s, FREE_BACK, c, rank), 1, dev)
        return out

    arrived = [send_in(0)]
    sent = 0
    try:
        for c in range(chunks):
            stream = attend[c % 2]
            with torch.cuda.stream(stream):
                stream.wait_event(arrived[c])
                for s in peers:
                    _C._stream_wait(box.flag(rank, READY_IN, c, s), 1, dev)
                    _C._stream_write(box.flag(rank, READY_IN, c, s), 0, dev)
                x = box.inbox[start[c] : start[c + 1]]
                nq, nkv = n_q[c], n_kv[c]
                try:
                    o = attn(
                        x[:nq].view(world * rows, -1, dim),
                        x[nq : nq + nkv].view(world * rows, -1, dim),
                        x[nq + nkv :].view(world * rows, -1, dim),
                    )
                finally:
                    for s in peers:  # chunk c of s's bytes is read: s may write it again
                        _C._stream_write(box.flag(s, FREE_IN, c, rank), 1, dev)
                o = _rows_2d(o if o.dtype == q.dtype else o.to(q.dtype))  # the output is q's dtype, as over NCCL
            if c + 1 < chunks:  # enqueued after this chunk's attention: the host stays ahead of the GPU
                arrived.append(send_in(c + 1))
            send_back(c, o, stream)
            sent = c + 1
    except BaseException:
        # attn raised (on every rank alike: the same chunk, the same shapes):
        # the chunks already sent back are taken in, so that the flags are
        # left as a call leaves them and the next call finds them so
        collect(sent, copy=False)
        raise
    return collect(chunks, copy=True)
