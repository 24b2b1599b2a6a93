"""The Ulysses layer's copy-engine transport (``transport="copy_engine"``,
docs/contract.md).

NCCL's all_to_all runs kernels: beside attention, which fills every
multiprocessor, they wait for SMs and slow attention down when they get them.
Here each rank writes its blocks straight into the other ranks' receive
buffers with cudaMemcpyAsync, which the GPU's copy engines carry out with no
kernel, and a one-element all_reduce after each group of copies tells every
rank that all ranks' copies have landed (each rank's all_reduce starts after
its own copies, in stream order).

Receive buffers are allocated once per (group, shape, dtype, device) and
opened by every other rank through CUDA IPC, on the shape's first call (a
collective; not inside CUDA-graph capture). They are kept for later calls.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from . import _C

NEEDS = "ulysses: transport=\"copy_engine\" needs CUDA tensors and wire_dtype=None"
SET_UP_FIRST = ("ulysses: transport=\"copy_engine\" sets up its buffers on a shape's first call; "
                "make one call before capturing")


def no_peer_access(rank: int, why: str) -> str:
    return (f"ulysses: transport=\"copy_engine\" needs every rank's GPU on one node with peer access "
            f"(rank {rank}: {why})")


class PeerBuffers:
    """A receive buffer on every rank of the group, ``local`` this rank's;
    ``addr[r]`` is rank r's buffer's device address as this process sees it
    (its own, or the IPC mapping of a peer's)."""

    def __init__(self, group, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.local = torch.empty(shape, dtype=dtype, device=device)
        self.barrier = torch.zeros(1, dtype=torch.int32, device=device)
        offers: List = [None] * world
        dist.all_gather_object(offers, (device.index, reduce_tensor(self.local)), group=group)
        self._peers: List[torch.Tensor] = []  # the opened mappings, kept alive with the buffers
        why = ""
        try:
            for r, (peer_device, (rebuild, args)) in enumerate(offers):
                if r == rank:
                    self._peers.append(self.local)
                    continue
                if not _C._peer_access(device.index, peer_device):
                    raise RuntimeError(f"GPU {device.index} cannot access GPU {peer_device}")
                self._peers.append(rebuild(*args))
        except Exception as e:  # noqa: BLE001 (any failure to open a peer means the transport cannot run)
            why = str(e) or type(e).__name__
        verdicts: List = [None] * world
        dist.all_gather_object(verdicts, why, group=group)
        for r, text in enumerate(verdicts):
            if text:
                raise ValueError(no_peer_access(r, text))
        self.addr = [t.data_ptr() for t in self._peers]


_BUFFERS: Dict[tuple, PeerBuffers] = {}


def buffers(group, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> PeerBuffers:
    """The group's receive buffers of this shape, set up on first use (every rank at once)."""
    key = (id(group), tuple(shape), dtype, device.index)
    if key not in _BUFFERS:
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(SET_UP_FIRST)
        _BUFFERS[key] = PeerBuffers(group, tuple(shape), dtype, device)
    return _BUFFERS[key]


def send(blocks: torch.Tensor, to: PeerBuffers, slot: int, group) -> None:
    """``blocks [world, ...]`` (contiguous): block d into rank d's buffer at
    ``[slot, rank]`` (the buffer viewed ``[slots, world, ...]``), on the current
    stream, then the barrier: when it returns on a rank's stream, every rank's
    blocks for this slot have landed there."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    nbytes = blocks[0].numel() * blocks.element_size()
    for d in range(world):
        _C._peer_copy(to.addr[d] + (slot * world + rank) * nbytes, blocks[d].data_ptr(), nbytes,
                      blocks.device.index)
    dist.all_reduce(to.barrier, group=group)


_STREAMS: Dict[int, torch.cuda.Stream] = {}


def stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream the transport's copies and barriers run on (one per device)."""
    if device.index not in _STREAMS:
        _STREAMS[device.index] = torch.cuda.Stream(device)
    return _STREAMS[device.index]
