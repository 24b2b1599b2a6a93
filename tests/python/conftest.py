import faulthandler
import functools
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
requires_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)


def poison_like(shape, dtype, device):
    """A tensor of random bytes (never zeros), so unwritten outputs show."""
    t = torch.empty(shape, dtype=dtype, device=device)
    b = t.view(torch.uint8) if t.numel() else t
    if t.numel():
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device=device))
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality for any dtype (fp8 included, NaN payloads included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a = a.contiguous()
    b = b.contiguous()
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def capture(call):
    """``call()`` once on a side stream (warm-up), then captured in a CUDA graph: ``(graph, what it returned)``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


def error_text(call) -> str:
    """What ``call()`` raised as ``"{type}: {message}"`` (ValueError or TypeError), or ``"no error"``."""
    try:
        call()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def rope_schema_args(q, k, v, positions, slots, k_pool, v_pool, check_slots=False, **options) -> tuple:
    """rope_pool_fused's arguments as its registered op takes them (torch.ops.attnprep.rope_pool_fused), from the
    tensors and the keyword options given, the rest at their defaults; for opcheck."""
    from attnprep._ops import RopeArgs

    kw = dict(head_dim=q.shape[-1], num_qo_heads=q.shape[-2], num_kv_heads=k.shape[-2], rope_base=1e4)
    kw.update(rotary_dim=None, is_neox=True, cos_sin_cache=None, k_scale=None, v_scale=None, kv_layout="NHD")
    kw.update(q_norm_weight=None, k_norm_weight=None, norm_eps=1e-6, norm_weight_offset=0.0)
    kw.update(mrope_section=None, mrope_interleaved=False, q_scale=None)
    kw.update(options)
    return (*RopeArgs(q, k, v, positions, slots, k_pool, v_pool, **kw), check_slots)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker, world, *args, timeout=180):
    """Runs ``worker(rank, world, port, results, *args)`` in ``world`` spawned
    processes (one distributed rank each); returns what every rank put on
    ``results``, sorted by rank, and the exit codes. A rank that never
    reports fails the call after ``timeout`` seconds (a hang fails a test,
    not CI); the processes are reaped or killed either way."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    # a rank still running 20 s before the call gives up prints its threads'
    # stacks on stderr, which the failing test shows: a hang says where
    dump_after = max(timeout - 20, 1)
    procs = [
        ctx.Process(target=_rank_main, args=(dump_after, worker, r, world, port, results) + args) for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        got = sorted((results.get(timeout=timeout) for _ in range(world)), key=lambda r: r[0])
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return got, [p.exitcode for p in procs]


def _rank_main(dump_after, worker, *args):
    faulthandler.dump_traceback_later(dump_after)
    worker(*args)


def assert_ranks_ok(worker, world, *args, timeout=180):
    """spawn_ranks, and every rank reported "ok" and exited cleanly."""
    got, codes = spawn_ranks(worker, world, *args, timeout=timeout)
    assert got == [(r, "ok") for r in range(world)], got
    assert all(c == 0 for c in codes), codes


def gloo_case_reports(body, world, cases, case, timeout=120):
    """What each rank reported for ``case`` (``[(rank, report)]``) and the exit codes, where one gloo group of
    ``world`` ranks ran ``body(rank, world, device, c)`` for every c of ``cases`` in turn: one group per (body, world)
    serves every case of a parametrized test, and each later case also shows the group survives an earlier error."""
    ran = _cases_in_one_group(body, world, tuple(cases), timeout)
    if isinstance(ran, Exception):
        raise AssertionError(f"the group of {world} ranks running {body.__name__} failed: {ran!r}")
    got, codes = ran
    return [(r, report[case] if isinstance(report, dict) else report) for r, report in got], list(codes)


@functools.cache
def _cases_in_one_group(body, world, cases, timeout):
    try:
        got, codes = spawn_ranks(run_rank, world, "gloo", _every_case, body, cases, timeout=timeout)
    except Exception as e:  # a rank that never reported: every case fails with it, none waits again
        return e
    return tuple(got), tuple(codes)


def _every_case(rank, world, device, body, cases):
    reports = {}
    for case in cases:
        try:
            reports[case] = body(rank, world, device, case)
        except Exception as e:  # as run_rank reports it, and the next case still runs
            reports[case] = repr(e)
    return reports


# NVLink multicast stays off on shared multi-GPU hosts (spawned ranks inherit these)
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def nccl_ranks_ok(world, body, *args, timeout=180):
    """``body`` on `world` GPUs, one NCCL rank each (skipped without them),
    multicast off; every rank must report "ok"."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    if not dist.is_nccl_available():
        pytest.skip("no NCCL")
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)
    assert_ranks_ok(run_rank, world, "nccl", body, *args, timeout=timeout)


def run_rank(rank, world, port, results, backend, body, *args):
    """One rank for spawn_ranks: joins the group (gloo on the CPU, or NCCL on
    GPU `rank`), reports ``body(rank, world, device, *args)`` (any exception
    as its repr, at once instead of a timeout), and leaves the group."""
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        device_id=device if backend == "nccl" else None,
    )
    try:
        results.put((rank, body(rank, world, device, *args)))
    except Exception as e:
        results.put((rank, repr(e)))
    finally:
        # The report reaches the parent first, and the ranks meet before the
        # group is torn down: torch's destroy_process_group now and then hangs
        # when one rank tears down while another is still inside the group
        # (seen with gloo on torch 2.4, pytorch/pytorch#75097, whose
        # maintainers advise the barrier).
        results.close()
        results.join_thread()
        dist.barrier()
        dist.destroy_process_group()
