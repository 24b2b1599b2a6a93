"""Timing helpers shared by bench/bench_<op>.py and `python -m attnprep`.

Kernel time: median of per-call CUDA events after warm-up, rotating among
several input sets when one set would fit in L2. Bandwidth is the bytes the
op must move (each input read once, each output written once) over that time,
reported against a device-to-device copy of the same bytes measured in the
same run. Launch-bound sizes are timed as CUDA-graph replays; host overhead
as wall time per call over many calls without a sync.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from typing import Callable, Iterator, Sequence

import torch

L2_BYTES = 60 << 20


def sets_needed(bytes_per_set: int) -> int:
    """How many input sets to rotate so that the working set exceeds L2 several times."""
    return max(1, min(8, (4 * L2_BYTES) // max(bytes_per_set, 1) + 1))


# ~0.5 ms of spinning ahead of each timed call, longer than any op's host-side cost (torch.compile's guards and
# launches for the QK-norm peer took over 100 us a call: a shorter spin let them into the kernel time).
SPIN_CYCLES = 1_000_000


def median_ms(fns: Sequence[Callable[[], object]], iters: int = 50, warmup: int = 5) -> float:
    """Median device time of one call in ms; call i uses fns[i % len(fns)].

    Each timed call is queued behind a short spin kernel, so the events
    measure the GPU work and not the host's time to launch it."""
    for i in range(warmup):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        torch.cuda._sleep(SPIN_CYCLES)
        starts[i].record()
        fns[i % len(fns)]()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def median_ms_interleaved(
    contenders: Sequence[Sequence[Callable[[], object]]], iters: int = 50, warmup: int = 5, seed: int = 0
) -> list[float]:
    """Median device time of one call of each contender (a list of calls, as
    median_ms takes), all timed in one loop: each round times one call of
    every contender, in a shuffled order, each call behind the spin kernel;
    the k-th call of the loop is call k of its contender's list, so that
    consecutive calls use different input sets.

    Timed one contender after another instead (median_ms in turn), a large
    copy's time alone moved by up to 2.5% with the measurement before it:
    the same kernel timed eight times in a row alternated between two values
    (the L2 state each measurement leaves to the next; an L2 flush before
    each one held it flat: docs/performance-notes.md, copy engine), so two
    contenders timed in turn could each land on either value. Interleaved,
    every contender sees the same mix of predecessors."""
    for i in range(warmup):
        for fns in contenders:
            fns[i % len(fns)]()
    torch.cuda.synchronize()
    order = list(range(len(contenders)))
    rng = random.Random(seed)
    timed: list[list[tuple[torch.cuda.Event, torch.cuda.Event]]] = [[] for _ in contenders]
    k = 0
    for _ in range(iters):
        rng.shuffle(order)
        for c in order:
            fns = contenders[c]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(SPIN_CYCLES)
            start.record()
            fns[k % len(fns)]()
            end.record()
            timed[c].append((start, end))
            k += 1
    torch.cuda.synchronize()
    return [statistics.median(s.elapsed_time(e) for s, e in pairs) for pairs in timed]


def copy_fns(nbytes: int) -> list[Callable[[], object]]:
    """Device-to-device copies that read and write `nbytes` each, over enough
    buffer pairs to rotate as sets_needed asks."""
    n = max(nbytes // 2, 1)
    sets = sets_needed(2 * nbytes)
    src = [torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_() for _ in range(sets)]
    dst = [torch.empty_like(s) for s in src]
    return [lambda s=s, d=d: d.copy_(s) for s, d in zip(src, dst)]


def copy_ms(nbytes: int, iters: int = 50) -> float:
    """Median time of a device-to-device copy that reads and writes `nbytes` each."""
    return median_ms(copy_fns(nbytes), iters)


def graph_replay_us(fn: Callable[[], object], calls: int = 20, replays: int = 200) -> float:
    """Time per call of `fn` when `calls` of them are replayed as one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / (replays * calls))
    return statistics.median(times)


def copy_replay_us(nbytes: int) -> float:
    """The floor of a launch-bound op's replay: a copy that reads and writes
    `nbytes` each through attnprep's own copy engine (with programmatic
    dependent launch, as the ops have it): pack_qkv_destination_major at
    world_size 1 (each row's heads interleaved, otherwise contiguous),
    replayed as graph_replay_us replays an op (inputs hot in L2, 20 calls
    per graph)."""
    import attnprep

    row = 3 * 8 * 128 * 2  # q, k, v of 8 heads of 128 bf16 elements
    rows = max(nbytes // row, 1)
    q, k, v = (torch.empty(rows, 8, 128, dtype=torch.bfloat16, device="cuda").normal_() for _ in range(3))
    out = attnprep.pack_qkv_destination_major(q, k, v, world_size=1)
    return graph_replay_us(lambda: attnprep.pack_qkv_destination_major(q, k, v, world_size=1, out=out))


def empty_kernel_replay_us(calls: int = 20, replays: int = 200) -> float:
    """The launch floor: an (almost) empty kernel, replayed the same way."""
    return graph_replay_us(lambda: torch.cuda._sleep(0), calls, replays)


@contextlib.contextmanager
def pdl(on: bool) -> Iterator[None]:
    """Programmatic dependent launch on/off for the launches (and graph
    captures) inside the block; back to the environment's setting after."""
    from attnprep import _C

    _C._set_pdl_mode(1 if on else 0)
    try:
        yield
    finally:
        _C._set_pdl_mode(-1)


def pdl_available() -> bool:
    from attnprep import _C

    with pdl(True):
        return _C._pdl_on(torch.cuda.current_device())


def host_us(fn: Callable[[], object], calls: int = 2000) -> float:
    """Wall time per call over `calls` calls without a sync (launch and binding cost)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e6 / calls


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for r in rows:
        print("| " + " | ".join(f"{c:.3g}" if isinstance(c, float) else str(c) for c in r) + " |")


def environment() -> str:
    return (
        f"{torch.cuda.get_device_name()} | torch {torch.__version__} | "
        f"CUDA {torch.version.cuda} | {time.strftime('%Y-%m-%d')}"
    )
