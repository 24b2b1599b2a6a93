"""Can the Ulysses exchange hide under attention if copy engines move it?

    python bench/diagnostics/ce_overlap.py          # one rank per visible GPU (2+), NCCL

Chunking the heads (bench_ulysses_dist.py --parts overlap) hid none of the
exchange: NCCL's kernels need SMs, and while attention's blocks fill the GPU
they wait for them, and slow attention down when they get them. A copy
engine needs no SMs. This measures, at the overlap shapes (rows per rank,
heads, head_dim), bf16, one rank per GPU:

- attention alone (SDPA over the whole sequence for this rank's heads);
- the exchange's bytes alone, each way as attnprep.ulysses sends them (one
  block per peer: [rows, heads / world, 3 * head_dim] in, [rows, heads /
  world, head_dim] out), moved by one NCCL all_to_all_single, and by copy
  engines: cudaMemcpyAsync into each peer's receive buffer, opened through
  CUDA IPC (attnprep's copy-engine transport's buffers), on a side stream;
- attention with each of the two running beside it on another stream,
  started together.

Exposed share = (both - attention alone) / exchange alone, for NCCL and for
the copy engines, causal and not. Then the copy engines' bytes are checked
against the sender's data after a barrier. Rank 0 prints the table.

Keep NVLink multicast off (set below if unset).
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from attnprep import _C, _peer  # noqa: E402

SHAPES = [(41984, 56, 128), (75600, 40, 128), (65536, 24, 128), (8192, 32, 128)]
ITERS = 5


def timed(fns, device):
    """Median ms of each of fns, in turn within every iteration (clock drift falls on all alike)."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(ITERS):
        for j, fn in enumerate(fns):
            dist.barrier()
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            times[j].append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def copy_engine_exchange(send, bufs, rank, world, stream):
    """send [world, ...]: block d to rank d's receive buffer (attnprep's
    copy-engine transport's, opened through CUDA IPC), slot `rank`, with
    cudaMemcpyAsync (no SMs)."""
    nbytes = send[0].numel() * send.element_size()
    with torch.cuda.stream(stream):
        for d in range(world):
            _C._peer_copy_2d(bufs.addr[d] + rank * nbytes, nbytes, send[d].data_ptr(), nbytes, nbytes, 1,
                             send.device.index)


class PeerBuffer:
    """A receive buffer on every rank, opened in every other rank through CUDA IPC (attnprep's transport's way)."""

    def __init__(self, shape, dtype, device):
        self.local = torch.zeros(shape, dtype=dtype, device=device)
        self.addr = _peer.open_peers(None, [self.local])[0]


def row(rank, world, device, rows, heads, dim, causal, side):
    dtype = torch.bfloat16
    h = heads // world
    g = torch.Generator(device=device).manual_seed(rank)
    q, k, v = (torch.randn(world * rows, h, dim, device=device, dtype=dtype, generator=g) for _ in range(3))
    send_in = torch.randn(world, rows, h, 3 * dim, device=device, dtype=dtype, generator=g)
    send_out = torch.randn(world, rows, h, dim, device=device, dtype=dtype, generator=g)
    recv_in, recv_out = torch.empty_like(send_in), torch.empty_like(send_out)
    ce_in = PeerBuffer(send_in.shape, dtype, device)
    ce_out = PeerBuffer(send_out.shape, dtype, device)

    def attention():
        F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=causal)

    def nccl():
        with torch.cuda.stream(side):
            dist.all_to_all_single(recv_in, send_in)
            dist.all_to_all_single(recv_out, send_out)

    def ce():
        copy_engine_exchange(send_in, ce_in, rank, world, side)
        copy_engine_exchange(send_out, ce_out, rank, world, side)

    def together(comm):
        def run():
            side.wait_stream(torch.cuda.current_stream(device))
            comm()
            attention()
            torch.cuda.current_stream(device).wait_stream(side)
        return run

    def alone(comm):
        def run():
            side.wait_stream(torch.cuda.current_stream(device))
            comm()
            torch.cuda.current_stream(device).wait_stream(side)
        return run

    t_attn, t_nccl, t_ce, t_both_nccl, t_both_ce = timed(
        [attention, alone(nccl), alone(ce), together(nccl), together(ce)], device)
    # the copy engines' bytes arrived: rank r's slot of my buffer is block `rank` of r's send buffer
    torch.cuda.synchronize(device)
    dist.barrier()
    ok = True
    for r in range(world):
        gen = torch.Generator(device=device).manual_seed(r)
        for _ in range(3):
            torch.randn(world * rows, h, dim, device=device, dtype=dtype, generator=gen)
        their_in = torch.randn(world, rows, h, 3 * dim, device=device, dtype=dtype, generator=gen)
        ok &= torch.equal(ce_in.local[r], their_in[rank])
    dist.barrier()
    return [t_attn, t_nccl, t_ce, t_both_nccl, t_both_ce,
            (t_both_nccl - t_attn) / t_nccl, (t_both_ce - t_attn) / t_ce, ok]


def worker(rank, world):
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    side = torch.cuda.Stream(device)
    try:
        rows_out = []
        for rows, heads, dim in SHAPES:
            for causal in (False, True):
                r = row(rank, world, device, rows, heads, dim, causal, side)
                rows_out.append([f"({rows}, {heads}, {dim})", causal] + r)
                torch.cuda.empty_cache()
        if rank == 0:
            print(f"\n### Exchange beside attention: NCCL against copy engines ({world} x "
                  f"{torch.cuda.get_device_name()}, torch {torch.__version__})\n")
            head = ["(rows per rank, heads, D)", "causal", "attention ms", "NCCL exchange ms", "copy-engine exchange ms",
                    "attention + NCCL ms", "attention + copy engines ms", "NCCL exposed", "copy engines exposed",
                    "copy-engine bytes correct"]
            print("| " + " | ".join(head) + " |")
            print("|" + "---|" * len(head))
            for r in rows_out:
                print("| " + " | ".join(f"{c:.3g}" if isinstance(c, float) else str(c) for c in r) + " |")
    finally:
        dist.destroy_process_group()


def main():
    world = torch.cuda.device_count()
    if world < 2:
        print("ce_overlap: needs 2+ CUDA devices; nothing run")
        return
    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29519")
    mp.spawn(worker, args=(world,), nprocs=world)


if __name__ == "__main__":
    main()
