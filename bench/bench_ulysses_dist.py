"""Ulysses attention across GPUs: correctness and the exchange's speed.

    torchrun --nproc-per-node 8 bench/bench_ulysses_dist.py            # NCCL, one GPU per rank
    python bench/bench_ulysses_dist.py                                  # the same, one rank per visible GPU
    python bench/bench_ulysses_dist.py --spawn 2 --backend gloo --smoke  # CPU check of the script itself

1. Correctness: the layer's output on every rank equals single-device
   attention over the whole sequence (bf16 on GPUs: max |error| <= 2e-2, the
   spread of bf16 attention outputs of unit-variance inputs; float64 on CPU:
   1e-12), for MHA and GQA, causal.
2. Speed, same run: the layer's exchange -- input side: pack + one
   all_to_all_single; output side: one all_to_all_single + usp_merge_heads --
   against the common baseline: three permute().contiguous() + three
   all_to_all_single in, all_to_all_single + permute().contiguous() out, at
   (global rows, heads, head_dim) = (41984, 56, 128), (75600, 40, 128),
   (65536, 24, 128). Median ms per exchange over 20 after 5 warm-ups, and
   the speed-up; and the local copies alone (pack vs the three permutes,
   no exchange).
3. The pack-free input side (``--parts input``), at (rows per rank, heads,
   head_dim) = (41984, 56, 128), (75600, 40, 128), (65536, 24, 128), (8192,
   32, 128), MHA, hidden = heads * head_dim: UlyssesQKVProjection (one batched
   GEMM writes the send buffer, then the all_to_all_single) against the
   projection + pack + exchange and the projection + three permutes + three
   all_to_alls; the projection GEMM alone for scale.
4. Overlap (``--parts overlap``): exposed communication = (layer time -
   attention alone on the same heads and sequence) / (exchange alone, both
   ways), with 1, 2 and 4 chunks (and 4 over a process group whose NCCL
   streams have high priority), causal and not, at the same shapes; the
   attention and the layers are timed in turn within each iteration.
5. fp8 on the wire (``--parts fp8``): each direction's exchange (pack or
   copy, quantize, all_to_all_single, dequantize, unpack or merge) with
   wire_dtype=float8_e4m3fn against bf16.
6. The copy-engine transport (``--parts ce``, NCCL runs only): attention
   alone, the exchange alone (the layer with an identity attention) through
   NCCL and through the copy engines, the layer through NCCL (1 chunk) and
   through the copy engines with 1, 2 and 4 chunks; exposed = (layer -
   attention alone) / the NCCL exchange alone. ``--parts ce_graph``: the
   same under CUDA-graph replay (attention, the NCCL exchange and layer,
   the copy-engine layer with 2 and 4 chunks), the host out of the time.
7. Chunk plans over the copy engines (``--parts plans``, NCCL runs only):
   graphs replayed in turn and timed by CUDA events, every time the slower
   rank's, exposed per iteration against that iteration's attention alone
   (plan_rows); ``--iters`` sets the iterations, ``--shapes`` other shapes.
Rank 0 prints the tables for bench/README.md.

Keep NCCL_NVLS_ENABLE=0 (set below if unset): NVLink multicast stays off.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from attnprep import ulysses  # noqa: E402

SHAPES = [(41984, 56, 128), (75600, 40, 128), (65536, 24, 128)]
# the pack-free, overlap and fp8 tables: rows per rank
RANK_SHAPES = [(41984, 56, 128), (75600, 40, 128), (65536, 24, 128), (8192, 32, 128)]


def timed(fn, device, iters=20, warmup=None):
    for _ in range(min(5, iters) if warmup is None else warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def destination_major(t, world):
    """[rows, heads, D] -> [W, rows, heads / W, D], the common way: one permute().contiguous()."""
    rows, heads, dim = t.shape
    return t.reshape(rows, world, heads // world, dim).permute(1, 0, 2, 3).contiguous()


def baseline_in(q, k, v, world):
    """Three permute().contiguous() and three all_to_all_single."""
    outs = []
    for t in (q, k, v):
        send = destination_major(t, world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        outs.append(recv)
    return outs


def baseline_out(o, world):
    total, h, dim = o.shape
    send = o.reshape(world, total // world, h, dim).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return recv.permute(1, 0, 2, 3).reshape(total // world, world * h, dim).contiguous()


def check(rank, world, device, dtype, rows, heads, kv, dim):
    g = torch.Generator().manual_seed(heads * 1000 + kv)
    q = torch.randn(world * rows, heads, dim, generator=g).to(dtype)
    k = torch.randn(world * rows, kv, dim, generator=g).to(dtype)
    v = torch.randn(world * rows, kv, dim, generator=g).to(dtype)
    mine = slice(rank * rows, (rank + 1) * rows)
    got = ulysses.ulysses_attention(q[mine].to(device), k[mine].to(device), v[mine].to(device), causal=True)
    want = ulysses.sdpa(causal=True)(q.to(device), k.to(device), v.to(device))[mine]
    err = (got.double() - want.double()).abs().max().item()
    tol = 1e-12 if dtype == torch.float64 else 2e-2
    return err, err <= tol


def input_side_rows(world, device, dtype, rows, heads, dim, iters):
    """(pack-free, projection + pack, projection + three permutes, projection alone) ms."""
    hidden = heads * dim
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, hidden, device=device, dtype=dtype, generator=g)
    w = [torch.randn(heads * dim, hidden, device=device, dtype=dtype, generator=g) * hidden**-0.5 for _ in range(3)]
    proj = ulysses.UlyssesQKVProjection.from_weights(*w, world, dim, validate=False)
    w_qkv = torch.cat(w)  # the plain projection, q | k | v

    def projected():
        qkv = x @ w_qkv.T
        return (t.view(rows, heads, dim) for t in qkv.split(heads * dim, dim=1))

    t_free = timed(lambda: proj(x), device, iters)
    t_pack = timed(lambda: ulysses.scatter_heads(*projected(), validate=False), device, iters)
    t_three = timed(lambda: baseline_in(*projected(), world), device, iters)
    t_gemm = timed(lambda: x @ w_qkv.T, device, iters)
    return t_free, t_pack, t_three, t_gemm


def timed_together(fns, device, iters):
    """Median ms of each of fns, run in turn within every iteration (the order
    rotating), so that clock and temperature drift over a long run fall on
    all of them alike instead of on whichever ran last."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for i in range(iters):
        for j in range(len(fns)):
            at = (i + j) % len(fns)
            dist.barrier()
            torch.cuda.synchronize() if device.type == "cuda" else None
            t0 = time.perf_counter()
            fns[at]()
            torch.cuda.synchronize() if device.type == "cuda" else None
            times[at].append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def overlap_rows(world, device, dtype, rows, heads, dim, causal, iters, priority_group):
    """ms of: attention alone, the exchange alone (both ways), the layer with
    1, 2 and 4 chunks, and with 4 chunks over a group whose NCCL streams have
    high priority."""
    g = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(rows, heads, dim, device=device, dtype=dtype, generator=g) for _ in range(3))
    ql, kl, vl = ulysses.scatter_heads(q, k, v, validate=False)
    attn = ulysses.sdpa(causal)
    t_x = timed(
        lambda: ulysses.gather_heads(ulysses.scatter_heads(q, k, v, validate=False)[0], validate=False), device, iters
    )

    def layer(chunks, group=None):
        return lambda: ulysses.ulysses_attention(q, k, v, group, causal=causal, validate=False, chunks=chunks)

    def attention_in_chunks(chunks):  # no exchange: what splitting the heads alone costs attention
        step = ql.shape[1] // chunks
        kstep = kl.shape[1] // chunks if kl.shape[1] >= chunks else 0
        for c in range(chunks):
            kv = slice(c * kstep, (c + 1) * kstep) if kstep else slice(None)
            attn(ql[:, c * step : (c + 1) * step], kl[:, kv], vl[:, kv])

    fns = [
        lambda: attn(ql, kl, vl),
        layer(1),
        layer(2),
        layer(4),
        layer(4, priority_group),
        lambda: attention_in_chunks(4),
    ]
    return [t_x] + timed_together(fns, device, iters)


def _layer_setup(device, dtype, rows, heads, dim, causal):
    """Inputs for the copy-engine tables: attention alone on contiguous [S,
    heads, D] tensors (the copy-engine layer's layout, on which SDPA runs
    fastest; scatter_heads' strided views cost it up to 5% at these shapes),
    and layer(chunks, transport, attn_fn) -> a call of the layer."""
    g = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(rows, heads, dim, device=device, dtype=dtype, generator=g) for _ in range(3))
    ql, kl, vl = (t.contiguous() for t in ulysses.scatter_heads(q, k, v, validate=False))
    attn = ulysses.sdpa(causal)

    def layer(chunks, transport, attn_fn=None):
        return lambda: ulysses.ulysses_attention(
            q, k, v, attn_fn=attn_fn, causal=causal, validate=False, chunks=chunks, transport=transport
        )

    layer.inputs = (q, k, v)
    return (lambda: attn(ql, kl, vl)), layer


def _identity(q_, k_, v_):
    return q_


def copy_engine_rows(world, device, dtype, rows, heads, dim, causal, iters):
    """ms of: attention alone, the exchange alone (the layer with an identity
    attention) through NCCL and through the copy engines, the layer through
    NCCL (1 chunk), and the layer through the copy engines with 1, 2 and 4
    chunks."""
    attention, layer = _layer_setup(device, dtype, rows, heads, dim, causal)
    fns = [
        attention,
        layer(1, "nccl", _identity),
        layer(1, "copy_engine", _identity),
        layer(1, "nccl"),
        layer(1, "copy_engine"),
        layer(2, "copy_engine"),
        layer(4, "copy_engine"),
    ]
    return timed_together(fns, device, iters)


def copy_engine_graph_rows(world, device, dtype, rows, heads, dim, causal, iters):
    """The same under CUDA-graph replay (each captured once, replays timed in
    turn), so the host's enqueueing is out of the layer's time as in a
    captured model: ms of attention alone, the NCCL exchange alone, the NCCL
    layer (1 chunk), and the copy-engine layer with 2 and 4 chunks."""
    attention, layer = _layer_setup(device, dtype, rows, heads, dim, causal)
    fns = [attention, layer(1, "nccl", _identity), layer(1, "nccl"), layer(2, "copy_engine"), layer(4, "copy_engine")]
    return timed_together([_captured(fn) for fn in fns], device, iters)


def replays_timed_in_turn(graphs, iters):
    """Per-iteration ms of each graph's replay (CUDA events on the current
    stream), all replayed in turn within every iteration, the order rotating;
    the ranks start each replay together. Returns (the slowest rank's ms,
    this rank's ms), each [graph][iteration]: a layer spanning the ranks
    goes at its slowest rank's pace, so its exposed time is measured against
    the slowest rank's attention alone."""
    times = [[] for _ in graphs]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(iters):
        for j in range(len(graphs)):
            at = (i + j) % len(graphs)
            dist.barrier()
            torch.cuda.synchronize()
            start.record()
            graphs[at]()
            end.record()
            end.synchronize()
            times[at].append(start.elapsed_time(end))
    slowest = torch.tensor(times, dtype=torch.float64, device="cuda")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist(), times


def _captured(fn):
    fn()  # the copy-engine transport sets up its buffers outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def edge_plan(local_q: int, edge: int):
    """A first and a last chunk of ``edge`` heads (MHA) around one chunk of
    the rest, for the transport's ``plan`` (each chunk's q heads)."""
    return (local_q,) if local_q < 3 * edge else (edge, local_q - 2 * edge, edge)


PLAN_VARIANTS = [
    "nccl, 1 chunk",
    "copy engines, 4 equal chunks",
    "edge plan, 1 kv group",
    "edge plan, 2 kv groups",
    "auto (growing plan)",
]


def plan_rows(world, device, dtype, rows, heads, dim, causal, iters):
    """Under CUDA-graph replay, timed by events and paired by iteration:
    (attention alone ms, each rank's attention alone ms, NCCL exchange alone ms, attention alone in the
    "auto" plan's chunks on two streams ms, {variant: exposed exchanges of
    each iteration}), each time the slowest rank's in its iteration, and each
    rank's own median of attention alone; for PLAN_VARIANTS: the NCCL layer,
    the copy-engine layer with 4 equal chunks, with edge plans of 1 and 2 kv
    groups (edge_plan) and with chunks="auto" (_peer.auto_plan).
    Exposed in iteration i = (layer_i - attention_i) / the NCCL exchange's
    median, so that the slow drift of attention's own time falls out of the
    difference."""
    from attnprep import _peer

    attention, layer = _layer_setup(device, dtype, rows, heads, dim, causal)
    local = heads // world

    def edge(groups):
        plan = edge_plan(local, groups)
        checked = ulysses.layer._checked(ulysses.sdpa(causal))
        return lambda: _peer.attention(*layer.inputs, None, checked, plan)

    def attention_in_plan(plan):  # no exchange: what the plan's split costs attention, chunks on two streams
        g = torch.Generator(device=device).manual_seed(2)
        parts = [
            [torch.randn(world * rows, h, dim, device=device, dtype=dtype, generator=g) for _ in range(3)] for h in plan
        ]
        attn, side = ulysses.sdpa(causal), torch.cuda.Stream(device)

        def run():
            main = torch.cuda.current_stream(device)
            side.wait_stream(main)
            for c, (q, k, v) in enumerate(parts):
                with torch.cuda.stream(main if c % 2 == 0 else side):
                    attn(q, k, v)
            main.wait_stream(side)

        return run

    fns = [
        attention,
        layer(1, "nccl", _identity),
        attention_in_plan(_peer.auto_plan(local, local, True, world * rows)),
        layer(1, "nccl"),
        layer(4, "copy_engine"),
        edge(1),
        edge(2),
        layer("auto", "copy_engine"),
    ]
    times, mine = replays_timed_in_turn([_captured(fn) for fn in fns], iters)
    t_x = statistics.median(times[1])
    exposed = {name: [(t - a) / t_x for t, a in zip(times[3 + n], times[0])] for n, name in enumerate(PLAN_VARIANTS)}
    each = [None] * world  # every rank's own median of attention alone
    dist.all_gather_object(each, statistics.median(mine[0]))
    return statistics.median(times[0]), each, t_x, statistics.median(times[2]), exposed


def spread(xs):
    """median (min to max) of a list"""
    return f"{statistics.median(xs):.2f} ({min(xs):.2f} to {max(xs):.2f})"


def fp8_rows(world, device, dtype, rows, heads, dim, iters):
    """(pack + quantize alone, dequantize alone, in bf16, in fp8, out bf16, out fp8, a2a of the bf16
    bytes, a2a of the fp8 bytes, copy of the bf16 bytes) ms.

    The last three give the floor of the fp8 speed-up: bf16 pays one copy
    (pack or merge) and the bf16 all_to_all; fp8 at best pays a quantizing
    pass and a dequantizing one (each reads 2 bytes and writes 1 per value:
    3/4 of a copy's traffic) and the fp8 all_to_all."""
    g = torch.Generator(device=device).manual_seed(2)
    q, k, v = (torch.randn(rows, heads, dim, device=device, dtype=dtype, generator=g) for _ in range(3))
    o = torch.randn(world * rows, heads // world, dim, device=device, dtype=dtype, generator=g)
    f8 = torch.float8_e4m3fn
    send16 = torch.empty(world, rows * 3 * heads * dim // world, device=device, dtype=dtype)
    recv16 = torch.empty_like(send16)
    n8 = rows * 3 * heads // world * (dim + 4)  # fp8 values and one float32 scale per head block
    send8 = torch.empty(world, n8, device=device, dtype=torch.uint8)
    recv8 = torch.empty_like(send8)
    wire = ulysses.exchange._pack_wire(q, k, v, world, f8)
    shape, n = ulysses.exchange._send_layout(q, k, world)
    plain = torch.empty(shape, dtype=dtype, device=device).view(world, rows, n, dim)
    return (
        timed(lambda: ulysses.exchange._pack_wire(q, k, v, world, f8), device, iters),
        timed(lambda: ulysses.wire._dequantize_into(wire, plain, f8), device, iters),
        timed(lambda: ulysses.scatter_heads(q, k, v, validate=False), device, iters),
        timed(lambda: ulysses.scatter_heads(q, k, v, validate=False, wire_dtype=f8), device, iters),
        timed(lambda: ulysses.gather_heads(o, validate=False), device, iters),
        timed(lambda: ulysses.gather_heads(o, wire_dtype=f8, validate=False), device, iters),
        timed(lambda: dist.all_to_all_single(recv16, send16), device, iters),
        timed(lambda: dist.all_to_all_single(recv8, send8), device, iters),
        timed(lambda: recv16.copy_(send16), device, iters),
    )


def overlap_cases(shapes, world):
    """The overlap tables' cases: the shapes whose heads per rank split into 4 chunks, non-causal and causal."""
    for rows, heads, dim in shapes:
        if heads // world % 4 == 0:
            for causal in (False, True):
                yield rows, heads, dim, causal


def exposed(layers, t_attn, t_x):
    """Each layer time as exposed exchanges ((layer - attention alone) / exchange alone), with its ms."""
    return " | ".join(f"{(t - t_attn) / t_x:.2f} ({t:.2f} ms)" for t in layers)


def extra_tables(rank, world, device, dtype, a):
    """Tables 3-5 (module docstring), printed by rank 0."""
    shapes = [(32, 4 * world, 16)] if a.smoke else RANK_SHAPES
    if a.shapes:
        shapes = [tuple(int(x) for x in one.split(",")) for one in a.shapes.split(";")]
    iters = 3 if a.smoke else 10
    out = []
    if "input" in a.parts:
        out += [
            "\n| (rows per rank, heads, head_dim) | pack-free projection + a2a ms | projection + pack + a2a ms | "
            "projection + 3 permutes + 3 a2a ms | speed-up vs pack | speed-up vs 3 a2a | projection GEMM alone ms |",
            "|---|---|---|---|---|---|---|",
        ]
        for rows, heads, dim in shapes:
            t_free, t_pack, t_three, t_gemm = input_side_rows(world, device, dtype, rows, heads, dim, iters)
            out.append(
                f"| ({rows}, {heads}, {dim}) | {t_free:.3f} | {t_pack:.3f} | {t_three:.3f} | "
                f"{t_pack / t_free:.2f}x | {t_three / t_free:.2f}x | {t_gemm:.3f} |"
            )
    if "overlap" in a.parts:
        out += [
            "\n| (rows per rank, heads, head_dim) | causal | attention alone ms | exchange alone (in + out) ms | "
            "exposed: 1 chunk | 2 chunks | 4 chunks | 4 chunks, high-priority NCCL streams | "
            "attention alone in 4 head chunks ms |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        priority = None
        if a.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = True
            priority = dist.new_group(backend="nccl", pg_options=options)
        for rows, heads, dim, causal in overlap_cases(shapes, world):
            t_x, t_attn, *layers, t_split = overlap_rows(
                world, device, dtype, rows, heads, dim, causal, 2 if a.smoke else 7, priority
            )
            out.append(
                f"| ({rows}, {heads}, {dim}) | {causal} | {t_attn:.2f} | {t_x:.2f} | "
                f"{exposed(layers, t_attn, t_x)} | {t_split:.2f} |"
            )
    if "ce" in a.parts and a.backend == "nccl":
        out += [
            "\n| (rows per rank, heads, head_dim) | causal | attention alone ms | exchange alone, NCCL ms | "
            "exchange alone, copy engines ms | exposed (of the NCCL exchange): NCCL, 1 chunk | copy engines, 1 chunk | "
            "2 chunks | 4 chunks |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for rows, heads, dim, causal in overlap_cases(shapes, world):
            t_attn, t_x, t_ce, *layers = copy_engine_rows(
                world, device, dtype, rows, heads, dim, causal, 2 if a.smoke else 7
            )
            out.append(
                f"| ({rows}, {heads}, {dim}) | {causal} | {t_attn:.2f} | {t_x:.2f} | {t_ce:.2f} | "
                f"{exposed(layers, t_attn, t_x)} |"
            )
    if "ce_graph" in a.parts and a.backend == "nccl":
        out += [
            "\n| (rows per rank, heads, head_dim) | causal | graphs: attention alone ms | NCCL exchange alone ms | "
            "exposed (of the NCCL exchange): NCCL, 1 chunk | copy engines, 2 chunks | 4 chunks |",
            "|---|---|---|---|---|---|---|",
        ]
        for rows, heads, dim, causal in overlap_cases(shapes, world):
            t_attn, t_x, *layers = copy_engine_graph_rows(
                world, device, dtype, rows, heads, dim, causal, 2 if a.smoke else 7
            )
            out.append(
                f"| ({rows}, {heads}, {dim}) | {causal} | {t_attn:.2f} | {t_x:.2f} | {exposed(layers, t_attn, t_x)} |"
            )
            torch.cuda.empty_cache()
    if "plans" in a.parts and a.backend == "nccl":
        out += [
            "\n| (rows per rank, heads, head_dim) | causal | graphs: attention alone, slowest rank ms | "
            'each rank\'s own ms | NCCL exchange alone ms | attention alone in the "auto" chunks ms | '
            "exposed (of the NCCL exchange), median (min to max) over iterations: " + " | ".join(PLAN_VARIANTS) + " |",
            "|---|---|---|---|---|---|" + "---|" * len(PLAN_VARIANTS),
        ]
        for rows, heads, dim, causal in overlap_cases(shapes, world):
            t_attn, each, t_x, t_split, exposed_by = plan_rows(
                world, device, dtype, rows, heads, dim, causal, 2 if a.smoke else a.iters
            )
            out.append(
                f"| ({rows}, {heads}, {dim}) | {causal} | {t_attn:.2f} | "
                f"{' / '.join(f'{t:.2f}' for t in each)} | {t_x:.2f} | {t_split:.2f} | "
                + " | ".join(spread(exposed_by[name]) for name in PLAN_VARIANTS)
                + " |"
            )
            torch.cuda.empty_cache()
    if "fp8" in a.parts:
        out += [
            "\n| (rows per rank, heads, head_dim) | in: bf16 ms | in: fp8 wire ms | in speed-up | out: bf16 ms | "
            "out: fp8 wire ms | out speed-up | a2a alone, bf16 / fp8 bytes ms | copy ms | floor speed-up | "
            "pack + quantize / dequantize alone ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for rows, heads, dim in shapes:
            pq, dq, i16, i8, o16, o8, a16, a8, cp = fp8_rows(world, device, dtype, rows, heads, dim, iters)
            floor = (cp + a16) / (1.5 * cp + a8)
            out.append(
                f"| ({rows}, {heads}, {dim}) | {i16:.3f} | {i8:.3f} | {i16 / i8:.2f}x | {o16:.3f} | "
                f"{o8:.3f} | {o16 / o8:.2f}x | {a16:.3f} / {a8:.3f} | {cp:.3f} | {floor:.2f}x | "
                f"{pq:.3f} / {dq:.3f} |"
            )
    if rank == 0 and out:
        print("\n".join(out))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="nccl")
    p.add_argument(
        "--parts",
        default="exchange,input,overlap,fp8,ce,ce_graph",
        help="comma-separated: exchange (tables 1-2), input, overlap, fp8, ce (copy-engine transport), "
        "ce_graph (the same under CUDA-graph replay), plans (copy-engine chunk plans, graphs, paired by iteration)",
    )
    p.add_argument("--smoke", action="store_true", help="small shapes (script check on CPU)")
    p.add_argument("--iters", type=int, default=9, help="iterations of the plans table")
    p.add_argument("--shapes", default="", help="rows,heads,dim;... (rows per rank) instead of the issue's shapes")
    p.add_argument("--spawn", type=int, default=0, help="start N local processes instead of torchrun")
    a = p.parse_args()
    a.parts = set(a.parts.split(","))
    if not a.spawn and "RANK" not in os.environ:  # not under torchrun: one rank per visible GPU
        if a.backend == "nccl" and torch.cuda.device_count() < 2:
            print("bench_ulysses_dist: needs 2+ CUDA devices (or --spawn N --backend gloo); nothing run")
            return
        a.spawn = torch.cuda.device_count() if a.backend == "nccl" else 2
    if a.spawn:
        import torch.multiprocessing as mp

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        mp.spawn(worker, args=(a.spawn, a), nprocs=a.spawn)
    else:
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a)


def worker(rank, world, a):
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    dist.init_process_group(a.backend, rank=rank, world_size=world)
    if a.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        dtype = torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), torch.float64
    try:
        if "exchange" in a.parts:
            exchange_tables(rank, world, device, dtype, a)
        extra_tables(rank, world, device, dtype, a)
    finally:
        dist.destroy_process_group()


def exchange_tables(rank, world, device, dtype, a):
    """Tables 1 and 2 (module docstring), printed by rank 0."""
    lines = []
    cases = [(8 * world, 8 * world), (8 * world, max(1, world // 2)), (8 * world, 2 * world)]
    for heads, kv in cases:
        err, ok = check(rank, world, device, dtype, 64 if a.smoke else 1024, heads, kv, 64)
        lines.append(f"| correctness | heads {heads}, kv {kv} | max err {err:.2e} | {'ok' if ok else 'FAIL'} |")
        assert ok, lines[-1]
    shapes = [(64 * world, 2 * world, 16)] if a.smoke else SHAPES
    rows_out = []
    for rows_g, heads, dim in shapes:
        rows = rows_g // world
        q, k, v = (torch.randn(rows, heads, dim, device=device, dtype=dtype) for _ in range(3))
        o = torch.randn(rows_g, heads // world, dim, device=device, dtype=dtype)
        t_in = timed(lambda: ulysses.scatter_heads(q, k, v, validate=False), device)
        t_in_base = timed(lambda: baseline_in(q, k, v, world), device)
        t_out = timed(lambda: ulysses.gather_heads(o, validate=False), device)
        t_out_base = timed(lambda: baseline_out(o, world), device)
        # the local copies alone, no exchange: where the difference comes from
        t_pack = timed(lambda: ulysses.exchange._pack(q, k, v, world), device)
        t_perm = timed(lambda: [destination_major(t, world) for t in (q, k, v)], device)
        rows_out.append(
            f"| ({rows_g}, {heads}, {dim}) | {t_in:.3f} | {t_in_base:.3f} | {t_in_base / t_in:.2f}x | "
            f"{t_out:.3f} | {t_out_base:.3f} | {t_out_base / t_out:.2f}x | "
            f"{t_pack:.3f} | {t_perm:.3f} |"
        )
    if rank == 0:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if a.backend == "nccl" else "-"
        print(
            f"\n### Ulysses exchange, {world} x {torch.cuda.get_device_name() if a.backend == 'nccl' else 'cpu'}"
            f" | torch {torch.__version__} | NCCL {nccl} | {time.strftime('%Y-%m-%d')}\n"
        )
        print("\n".join(lines))
        print(
            "\n| (global rows, heads, head_dim) | in: attnprep ms | in: 3x permute+a2a ms | in speed-up |"
            " out: attnprep ms | out: a2a+permute ms | out speed-up | pack alone ms | 3 permutes alone ms |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        print("\n".join(rows_out))


if __name__ == "__main__":
    main()
