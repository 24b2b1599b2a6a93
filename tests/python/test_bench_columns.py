"""The benchmarks' tables put each contender's time in its own column.

bench/bench_*.py run here on the CPU: their CUDA allocations land on the CPU,
attnprep's ops are replaced by attnprep.testing's references (rope_pool_fused
by the benchmark's own plain-PyTorch composition, which its checks compare
the peers with), the compilers by the eager functions, and the timer answers
contender i of each interleaved loop with i + 1 ms after calling every one of
its calls once. Each column can then be traced to the contender that filled
it: a table that took the copy's time for attnprep's, or one peer's for
another's, fails here instead of on a GPU run."""

import contextlib
import functools
import math
import pathlib
import sys

import attnprep
import pytest
import torch
from attnprep import _bench as common
from attnprep.testing import (
    merge_reference,
    mla_reference,
    mrope_cos_sin_rows,
    pack_reference,
    quantize_reference,
    rope_reference,
)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import bench_mla_rope_pool  # noqa: E402
import bench_pack_qkv  # noqa: E402
import bench_qk_norm_rope  # noqa: E402
import bench_rope_pool  # noqa: E402
import bench_usp_merge_heads  # noqa: E402
import peers  # noqa: E402

GRAPH_US, COPY_GRAPH_US, EMPTY_US, HOST_US = 0.5, 0.25, 0.125, 7.0


def fake_rope_pool_fused(
    q,
    k,
    v,
    positions,
    slots,
    k_pool,
    v_pool,
    head_dim,
    num_qo_heads,
    num_kv_heads,
    rope_base,
    q_norm_weight=None,
    k_norm_weight=None,
    norm_eps=1e-6,
    cos_sin_cache=None,
    kv_layout=None,
    k_scale=None,
    v_scale=None,
    mrope_section=None,
    mrope_interleaved=False,
    q_scale=None,
):
    b = bench_rope_pool
    if q_norm_weight is not None:
        q, k = b.rms_norm_model(q, q_norm_weight, norm_eps), b.rms_norm_model(k, k_norm_weight, norm_eps)
    if mrope_section is not None or positions is None:  # cos/sin rows of the table
        rows = cos_sin_cache
        if mrope_section is not None:
            rows = mrope_cos_sin_rows(cos_sin_cache, positions, mrope_section, mrope_interleaved)
        half = rows.shape[1] // 2
        q_rot, k_rot = (rope_reference(x, rows[:, :half], rows[:, half:], 2 * half, True).to(x.dtype) for x in (q, k))
        k_pool.index_copy_(0, slots, k_rot)
        v_pool.index_copy_(0, slots, v)
    elif kv_layout is None:
        q_rot, k_rot = b.torch_rope_pool(q, k, v, positions, slots, k_pool, v_pool, b.inv_freq())
    else:
        page = k_pool.shape[1] if kv_layout == "NHD" else k_pool.shape[2]
        q_rot, k_rot = b.torch_rope_paged(
            q, k, v, positions, slots, k_pool, v_pool, b.inv_freq(), kv_layout, page, k_scale, v_scale
        )
    if q_scale is not None:
        q_rot = quantize_reference(q_rot, q_scale, torch.float8_e4m3fn)
    return q_rot, k_rot, k_pool, v_pool


def fake_mla_rope_pool_fused(q, kv_c, k_pe, positions, slots, cache, cos_sin_cache, kv_norm_weight, cache_scale, **kw):
    """mla_rope_pool_fused in place, from attnprep.testing's reference."""
    q_rot, k_rot, latent = mla_reference(
        q, kv_c, k_pe, positions, cos_sin_cache=cos_sin_cache, kv_norm_weight=kv_norm_weight
    )
    q.copy_(q_rot.to(q.dtype))
    k_pe.copy_(k_rot.to(k_pe.dtype))
    row = torch.cat([latent, k_pe], -1)
    if cache_scale is not None:
        row = quantize_reference(row[:, None], cache_scale, cache.dtype)[:, 0]
    cache[slots // cache.shape[1], slots % cache.shape[1]] = row
    return q, k_pe, cache, None


@pytest.fixture
def on_cpu(monkeypatch):
    def drop_device(f):
        @functools.wraps(f)
        def g(*a, **kw):
            kw.pop("device", None)
            return f(*a, **kw)

        return g

    for name in ("randn", "rand", "randint", "randperm", "empty", "zeros", "tensor"):
        monkeypatch.setattr(torch, name, drop_device(getattr(torch, name)))
    generator = torch.Generator
    monkeypatch.setattr(torch, "Generator", lambda device=None: generator())
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **kw: self)

    def timer(contenders, iters=50, warmup=5, seed=0):
        for calls in contenders:
            for call in calls:
                call()
        return [float(i + 1) for i in range(len(contenders))]

    monkeypatch.setattr(common, "median_ms_interleaved", timer)
    monkeypatch.setattr(common, "copy_fns", lambda nbytes: [lambda: None])
    monkeypatch.setattr(common, "graph_replay_us", lambda fn, *a, **kw: (fn(), GRAPH_US)[1])
    monkeypatch.setattr(common, "copy_replay_us", lambda nbytes: COPY_GRAPH_US)
    monkeypatch.setattr(common, "empty_kernel_replay_us", lambda *a, **kw: EMPTY_US)
    monkeypatch.setattr(common, "host_us", lambda fn, calls=2000: HOST_US)
    monkeypatch.setattr(common, "pdl", lambda on: contextlib.nullcontext())
    monkeypatch.setattr(common, "pdl_available", lambda: True)
    monkeypatch.setattr(common, "environment", lambda: "cpu")
    monkeypatch.setattr(peers, "compiled_static", lambda fn, *example: fn)
    monkeypatch.setattr(peers, "triton", None)

    def pack(q, k, v, world_size, out=None):
        want = pack_reference(q, k, v, world_size)
        return want if out is None else out.copy_(want)

    monkeypatch.setattr(attnprep, "pack_qkv_destination_major", pack)
    monkeypatch.setattr(attnprep, "usp_merge_heads", merge_reference)
    monkeypatch.setattr(attnprep, "rope_pool_fused", fake_rope_pool_fused)
    monkeypatch.setattr(attnprep, "rope_cos_sin_cache", lambda d, n, base, device=None: torch.zeros(n, d))
    monkeypatch.setattr(bench_rope_pool, "POOL", 1 << 12)
    monkeypatch.setattr(bench_rope_pool, "MAXPOS", 1 << 10)
    bench_rope_pool.cos_sin_cache.cache_clear()
    yield
    bench_rope_pool.cos_sin_cache.cache_clear()


def tables(out):
    """{title: rows of cells} of the markdown tables printed."""
    found, rows = {}, None
    for line in out.splitlines():
        if line.startswith("### "):
            rows = found.setdefault(line[4:], [])
        elif line.startswith("| ") and rows is not None:
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return {title: rows[1:] for title, rows in found.items()}  # without the header row


def table(out, title_start):
    (rows,) = [rows for title, rows in tables(out).items() if title.startswith(title_start)]
    return rows


def numbers(row, names):
    """The row's cells as floats where they are numbers, names (strings) kept."""

    def cell(c):
        try:
            return float(c)
        except ValueError:
            return c

    got = [cell(c) for c in row]
    assert [c for c in got if isinstance(c, str)][1:] == names, got
    return got


def close(got, want):
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want):
        if isinstance(w, float) and math.isnan(w):
            assert isinstance(g, float) and math.isnan(g), (got, want)
        elif isinstance(w, float):
            assert g == pytest.approx(w, rel=5e-3), (got, want)
        else:
            assert g == w, (got, want)


NAN = float("nan")


def test_merge_table(on_cpu, capsys, monkeypatch):
    monkeypatch.setattr(bench_usp_merge_heads, "SHAPES", [(2, 17, 1, 3, 16)])
    bench_usp_merge_heads.run()
    (row,) = table(capsys.readouterr().out, "usp_merge_heads")
    # contenders: attnprep 1 ms, copy 2, eager permute 3, eager copy_ 4, compiled permute 5, compiled copy_ 6
    close(
        numbers(row, ["permute + contiguous"]),
        ["(2, 17, 1, 3, 16)", 1e3, 200.0, 5e3, 40.0, "permute + contiguous", NAN, NAN, 3e3, 66.7, 3.0],
    )


def test_pack_tables(on_cpu, capsys, monkeypatch):
    monkeypatch.setattr(bench_pack_qkv, "SHAPES", [(17, 8, 16, 2, True)])
    bench_pack_qkv.run()
    out = capsys.readouterr().out
    first = list(peers.PACK_FORMULATIONS)[0]
    n = len(peers.PACK_FORMULATIONS)
    (row,) = table(out, "pack_qkv_destination_major")
    # contenders: attnprep 1 ms, copy 2, the eager formulations 3.., the compiled ones after them
    close(
        numbers(row, [first, first]),
        ["(17, 8, 16, 2) fused", 1e3, 200.0, (3 + n) * 1e3, 200.0 / (3 + n), first, NAN, NAN, 3e3, 66.7, first, 3.0],
    )
    replay = table(out, "CUDA-graph replay")
    assert [r[0] for r in replay] == ["1", "65", "512"]
    for r in replay:
        close(numbers(r, []), [float(r[0]), GRAPH_US, GRAPH_US, EMPTY_US, GRAPH_US / EMPTY_US, GRAPH_US, NAN])
    host = dict((r[0], float(r[1])) for r in table(out, "Host time"))
    assert host["dispatcher / direct"] == 1.0 and host["attnprep (out=)"] == HOST_US


def test_rope_table(on_cpu, capsys):
    bench_rope_pool.run(ts=[1, 8])
    rows = table(capsys.readouterr().out, "rope_pool_fused, bf16")
    # contenders: op 1 ms, op with cos_sin_cache 2, copy 3, copy with the table rows 4, eager 5, compiled 6
    assert len(rows) == 2
    for row, T in zip(rows, (1, 8)):
        got = numbers(row, [])
        del got[2]  # GB/s: the op's bytes over its time
        close(
            got,
            [
                float(T),
                1e3,
                300.0,
                GRAPH_US,
                GRAPH_US,
                COPY_GRAPH_US,
                2e3,
                200.0,
                GRAPH_US,
                6e3,
                50.0,
                GRAPH_US,
                5e3,
                6.0,
                NAN,
                NAN,
                NAN,
                NAN,
            ],
        )


def cpu_writes_fp8():
    """Whether this torch fills and scatters fp8 tensors on the CPU (2.4 does neither), as the
    benchmark's plain-torch peer does into its fp8 pools."""
    try:
        torch.zeros(2, dtype=torch.float8_e4m3fn)[torch.tensor([1])] = torch.ones(1).to(torch.float8_e4m3fn)
        return True
    except RuntimeError:
        return False


@pytest.mark.skipif(not cpu_writes_fp8(), reason="this torch cannot write fp8 tensors on the CPU")
def test_rope_formats_table(on_cpu, capsys):
    bench_rope_pool.run_formats(ts=[8])
    rows = table(capsys.readouterr().out, "rope_pool_fused into paged")
    assert len(rows) == len(bench_rope_pool.FORMATS)
    # contenders: op 1 ms, op with cos_sin_cache 2, copy 3, copy with the table rows 4, the two peers 5 and 6
    peer = list(bench_rope_pool.PAGED_PEERS)[0]
    for row in rows:
        close(
            numbers(row, [peer]),
            [row[0], 8.0, 1e3, 300.0, GRAPH_US, COPY_GRAPH_US, 2e3, 200.0, GRAPH_US, peer, 5e3, GRAPH_US, 5.0],
        )


def test_mla_table(on_cpu, capsys, monkeypatch):
    monkeypatch.setattr(attnprep, "mla_rope_pool_fused", fake_mla_rope_pool_fused)
    monkeypatch.setattr(attnprep, "rope_cos_sin_cache", lambda d, n, base, **kw: torch.zeros(n, d))
    monkeypatch.setattr(bench_mla_rope_pool, "POOL", 1 << 14)
    bench_mla_rope_pool.run(quick=True)
    rows = table(capsys.readouterr().out, "mla_rope_pool_fused")
    assert [row[:2] for row in rows] == [[c, t] for c in ("bfloat16", "float8_e4m3fn") for t in ("128", "8192")]
    # contenders: op 1 ms, copy 2, the compiled model 3 (no Triton here); GB/s (column 3) left out
    for row in rows:
        small = row[1] == "128"
        got = numbers(row, [])
        want = [row[0], float(row[1]), 1e3, 200.0, GRAPH_US if small else NAN, COPY_GRAPH_US if small else NAN]
        close(got[:3] + got[4:], want + [3e3, GRAPH_US if small else NAN, 3.0, NAN, NAN, NAN])


def test_rope_norm_table(on_cpu, capsys):
    bench_rope_pool.run_norm(ts=[8])
    rows = table(capsys.readouterr().out, "rope_pool_fused with the QK norm")
    assert [r[0] for r in rows] == ["32/8", "64/8"]
    # contenders: norm 1 ms, RoPE alone 2, norm with cos_sin_cache 3, copy 4, copy with the table rows 5,
    # the two compiled peers 6 and 7
    peer = list(bench_rope_pool.NORM_PEERS)[0]
    for row in rows:
        close(
            numbers(row, [peer]),
            [
                row[0],
                8.0,
                1e3,
                400.0,
                0.5,
                GRAPH_US,
                COPY_GRAPH_US,
                3e3,
                5 / 3 * 100,
                GRAPH_US,
                peer,
                6e3,
                GRAPH_US,
                6.0,
                1.0,
                NAN,
                NAN,
                NAN,
                NAN,
            ],
        )


def test_rope_mrope_table(on_cpu, capsys, monkeypatch):
    def real_table(d, n, base, device=None):  # a real table: the bench checks its peers against attnprep's values
        angle = torch.arange(n, dtype=torch.float32)[:, None] * bench_rope_pool.inv_freq()
        return torch.cat([angle.cos(), angle.sin()], dim=1)

    monkeypatch.setattr(attnprep, "rope_cos_sin_cache", real_table)
    bench_rope_pool.run_mrope(ts=[8])
    rows = table(capsys.readouterr().out, "rope_pool_fused with M-RoPE")
    assert [r[0] for r in rows] == list(bench_rope_pool.MROPE_MODELS)
    # contenders: M-RoPE 1 ms, one position 2, copy with the table rows 3, the compiled peer 4 (no Triton here)
    for row in rows:
        close(
            numbers(row, []),
            [row[0], 8.0, 1e3, 300.0, 0.5, GRAPH_US, COPY_GRAPH_US, 4e3, GRAPH_US, 4.0, NAN, NAN, NAN],
        )


def test_qk_norm_rope_table(on_cpu, capsys, monkeypatch):
    for name in ("arange", "linspace"):
        f = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, f=f, **kw: f(*a, **{k: v for k, v in kw.items() if k != "device"}))

    def fake_qk_norm_rope(q, k, cos_sin_cache, is_neox, q_norm_weight, k_norm_weight):
        half = cos_sin_cache.shape[1] // 2
        cos, sin = (x.repeat_interleave(2, 1)[:, None] for x in (cos_sin_cache[:, :half], cos_sin_cache[:, half:]))
        return bench_qk_norm_rope.diffusers_norm_rope(q, k, q_norm_weight, k_norm_weight, cos, sin)

    monkeypatch.setattr(attnprep, "qk_norm_rope", fake_qk_norm_rope)
    monkeypatch.setattr(bench_qk_norm_rope, "SHAPES", [("a", 2, 6, 3, "head"), ("b", 1, 5, 2, "token")])
    bench_qk_norm_rope.run()
    rows = table(capsys.readouterr().out, "qk_norm_rope")
    # contenders: attnprep 1 ms, the copy 2, compiled 3, eager 4; graphs where S <= 256
    for row, (_, B, S, H, over) in zip(rows, bench_qk_norm_rope.SHAPES):
        nbytes = 2 * (2 * B * S * H * 128 * 2) + S * 128 * 4
        close(
            numbers(row, [f"{B} x {S}", over]),
            [row[0], f"{B} x {S}", float(H), over, 1e3, common.gbps(nbytes, 1.0), 200.0, GRAPH_US]
            + [3e3, GRAPH_US, 3.0, 4e3],
        )
    assert len(rows) == 2


def test_compiled_peers_at_their_best(monkeypatch):
    """The compiled peer's columns: its name and kernel time from the formulation fastest by kernel time,
    its graph replay from whichever formulation replays fastest (here the other one), none at large T."""
    replay = {"launches fewer kernels": 3.0, "faster kernels": 5.0}
    monkeypatch.setattr(common, "graph_replay_us", lambda fn: replay[fn()])
    ms = {"faster kernels": 1e-3, "launches fewer kernels": 2e-3}
    calls = {name: (lambda name=name: name) for name in ms}
    assert bench_rope_pool.fastest_compiled(ms, calls, True) == ("faster kernels", 1e-3, 3.0)
    name, tc, graph = bench_rope_pool.fastest_compiled(ms, calls, False)
    assert (name, tc) == ("faster kernels", 1e-3) and math.isnan(graph)
