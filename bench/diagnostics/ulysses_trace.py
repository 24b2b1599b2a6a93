"""Where a Ulysses layer call's time goes on the GPU: a torch.profiler
timeline of one call per variant, rank 0's GPU work listed in start order
(offset and duration in ms, stream, kernel or copy).

    python bench/diagnostics/ulysses_trace.py                 # one rank per visible GPU (2+), NCCL
    python bench/diagnostics/ulysses_trace.py 41984,56,1      # rows per rank, heads, causal (0/1)
    python bench/diagnostics/ulysses_trace.py --graph ...     # one replay of each layer captured as a graph

Variants: the NCCL layer with 1 and 4 chunks, the copy-engine layer with 1
and 4 chunks and chunks="auto" (bf16, head_dim 128, SDPA). Each is called
twice first (set-up, warm-up); the ranks start the traced call together.
Each listing opens with the time in which no attention kernel runs (before
the first, between them, after the last): the exchange's part that
attention does not hide, without attention's own run-to-run spread. Chrome
traces go to $OUT (default /tmp) as trace_<rows>_<variant>[_graph].json. This is how the
copy-engine transport's flags, streams and chunk overlap were checked
(docs/performance-notes.md, "Ulysses overlap").

Keep NVLink multicast off (set below if unset).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from attnprep import ulysses  # noqa: E402

SHAPES = [(8192, 32, False), (41984, 56, True)]
VARIANTS = {"nccl1": (1, "nccl"), "nccl4": (4, "nccl"), "ce1": (1, "copy_engine"), "ce4": (4, "copy_engine"),
            "ceauto": ("auto", "copy_engine")}
MIN_MS = 0.01  # shorter GPU operations are left out of the listing


ATTENTION_KERNELS = ("sdpa", "flash", "fmha", "attention")  # name parts of SDPA's kernels


def outside_attention(events):
    """(before the first attention kernel, gaps between attention kernels,
    after the last) in ms: the span's time in which no attention kernel
    runs, which is the exchange's share that attention does not hide."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if any(part in e.name.lower() for part in ATTENTION_KERNELS))
    if not spans:
        return None
    t0, t1 = events[0].time_range.start, max(e.time_range.end for e in events)
    gaps, end = 0, spans[0][1]
    for a, b in spans[1:]:
        gaps += max(0, a - end)
        end = max(end, b)
    return (spans[0][0] - t0) / 1e3, gaps / 1e3, (t1 - end) / 1e3


def trace(rank, device, rows, heads, causal, name, chunks, transport, graph):
    g = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(rows, heads, 128, device=device, dtype=torch.bfloat16, generator=g) for _ in range(3))

    def call():
        return ulysses.ulysses_attention(q, k, v, causal=causal, validate=False, chunks=chunks, transport=transport)

    for _ in range(2):
        call()
    if graph:  # the layer as a captured model runs it: the host's enqueueing out of the timeline
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            call()
        captured.replay()
        call = captured.replay
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    if rank != 0:
        return
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    t0, t1 = events[0].time_range.start, max(e.time_range.end for e in events)
    print(f"\n## ({rows}, {heads}, 128), causal {causal}, {name}{', graph' if graph else ''}: "
          f"GPU span {(t1 - t0) / 1e3:.3f} ms")
    outside = outside_attention(events)
    if outside:
        print("  no attention kernel running: %.3f ms before, %.3f between, %.3f after" % outside)
    for e in events:
        ms = (e.time_range.end - e.time_range.start) / 1e3
        if ms >= MIN_MS:
            print(f"  {(e.time_range.start - t0) / 1e3:8.3f} +{ms:7.3f}  stream {e.device_resource_id:<3} {e.name[:72]}")
    prof.export_chrome_trace(os.path.join(os.environ.get("OUT", "/tmp"),
                                          f"trace_{rows}_{name}{'_graph' if graph else ''}.json"))


def worker(rank, world, shapes, graph):
    dist.init_process_group("nccl", rank=rank, world_size=world, init_method="tcp://127.0.0.1:29541",
                            device_id=torch.device("cuda", rank))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    try:
        for rows, heads, causal in shapes:
            for name, (chunks, transport) in VARIANTS.items():
                trace(rank, device, rows, heads, causal, name, chunks, transport, graph)
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()


def main():
    world = torch.cuda.device_count()
    if world < 2:
        print("ulysses_trace: needs 2+ CUDA devices; nothing run")
        return
    args = [a for a in sys.argv[1:] if a != "--graph"]
    shapes = [(int(r), int(h), bool(int(c))) for r, h, c in (a.split(",") for a in args)] or SHAPES
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(world, shapes, "--graph" in sys.argv[1:]), nprocs=world)


if __name__ == "__main__":
    main()
