"""Benchmark rope_pool_fused (bf16, q 32 heads, k/v 8 heads, head_dim 128,
pool of 2^20 slots, random positions below 131072, random distinct slots).

    python bench/bench_rope_pool.py [--quick]

Per T: median kernel time (CUDA events; attnprep, the copies and every peer
of a row timed call by call in one interleaved loop), effective GB/s (q, k, v, positions,
slots read once; q_rot, k_rot and the pool rows written once) and % of a
device-to-device copy of the same bytes, measured in the same run; CUDA-graph
replay per call for T <= 512 (20 calls back to back per graph), with
programmatic dependent launch (PDL) on and off, beside the replay of a copy
of the same bytes (the floor); the same three with cos/sin read from a
cos_sin_cache table, as vLLM and SGLang call it (its rows counted in the
copy's bytes) instead of computed from rope_base; the plain-PyTorch
composition (rope on q and k, then index_copy_ into the pools) eager and
under torch.compile (compiled per T, static shapes), and a Triton kernel of
the kind servers ship (bench/peers.py: cos/sin from cos_sin_cache, flat
pools; compare it with the cache columns). Then the paged / fp8
cache table, and the QK-norm table (q/k RMSNorm + RoPE + pool write, 32/8 and
64/8 heads, beside RoPE alone on the same data; the compiled peer in its
fastest of two formulations), and the M-RoPE table (positions [3, T] of a
VL prompt: Qwen2.5-VL's sections, Qwen3-VL's interleaved sections with its QK
norm; beside one position per token on the same table; the model's own
formulation compiled, the Triton peer gathering rows by axis).
``--only rope|formats|norm|mrope`` runs one table, ``--ts 2048,8192`` only
those token counts.
"""

from __future__ import annotations

import argparse
import functools

import attnprep
import peers
import torch
from attnprep import _bench as common
from attnprep.testing import mrope_cos_sin_rows

HQ, HKV, D, POOL, MAXPOS, BASE = 32, 8, 128, 1 << 20, 131072, 10000.0
TS = [1, 8, 32, 128, 512, 2048, 8192, 32768]


def inv_freq():
    i = torch.arange(D // 2, dtype=torch.float64)
    return (1.0 / BASE ** (2 * i / D)).float().cuda()


@functools.lru_cache(maxsize=None)
def cos_sin_cache():
    """The [MAXPOS, D] float32 table (cos half, sin half) that servers pass, built once."""
    return attnprep.rope_cos_sin_cache(D, MAXPOS, BASE, device="cuda")


def timed(contenders: dict, iters: int) -> dict:
    """Median ms of each named contender (a list of calls over the input sets), all timed call by call in
    one interleaved loop (common.median_ms_interleaved says why)."""
    return dict(zip(contenders, common.median_ms_interleaved(list(contenders.values()), iters)))


def cache_copy_fns(nbytes, T):
    """A copy of the op's bytes plus the cos_sin_cache rows read (D float32 per token)."""
    return common.copy_fns((nbytes + T * D * 4) // 2)


def through_cache(call, sets, t, tcopy, replay):
    """attnprep reading cos/sin from cos_sin_cache, as vLLM and SGLang call it: [us, % of a copy
    of the same bytes plus the table rows read, graph replay us]."""
    graph = common.graph_replay_us(lambda: call(sets[0], cos_sin_cache())) if replay else float("nan")
    return [t * 1e3, 100 * tcopy / t, graph]


CACHE_COLUMNS = ["cos_sin_cache us", "% of copy, cache", "graph replay, cache us"]
TRITON_COLUMNS = ["Triton us", "Triton % of copy, cache", "Triton graph us", "Triton warps"]


def op_and_copy_calls(sets, k_pool, v_pool, kw, nbytes, T) -> dict:
    """attnprep's calls over the sets (positions and the table built from rope_base, and cos_sin_cache), and the
    copies of the same bytes (and of the table rows read)."""
    return {
        "op": [lambda s=s: attnprep.rope_pool_fused(*s, k_pool, v_pool, **kw) for s in sets],
        "op+cache": [
            lambda s=s: attnprep.rope_pool_fused(*s, k_pool, v_pool, **kw, cos_sin_cache=cos_sin_cache()) for s in sets
        ],
        "copy": common.copy_fns(nbytes // 2),
        "copy+cache": cache_copy_fns(nbytes, T),
    }


def triton_calls(sets, k_pool, v_pool, check, norm=()):
    """The Triton peer's calls over the sets (bench/peers.py; cos/sin from cos_sin_cache, flat pools), each
    checked first on this data against attnprep's `check(s, cache)` (q_rot, k_rot) within a bf16 ulp or two;
    None without Triton."""
    if peers.triton is None:
        return None
    cache = cos_sin_cache()
    for s in sets:
        got = peers.triton_rope_pool(*s, k_pool, v_pool, cache, *norm)
        assert torch.equal(k_pool[s[4]], got[1]) and torch.equal(v_pool[s[4]], s[2]), "Triton pool mismatch"
        for g, want in zip(got, check(s, cache)):
            err = ((g.float() - want.float()).abs().max() / want.float().abs().max()).item()
            assert err < 2e-2, f"the Triton peer differs from attnprep by {err}"
    return [lambda s=s: peers.triton_rope_pool(*s, k_pool, v_pool, cache, *norm) for s in sets]


def triton_columns(sets, k_pool, v_pool, t, tcopy, replay, norm=()):
    """[us, % of a copy of the same bytes plus the table rows, graph replay us, the warps its autotuner chose]."""
    if t is None:
        return [float("nan")] * len(TRITON_COLUMNS)
    graph = (
        common.graph_replay_us(lambda: peers.triton_rope_pool(*sets[0], k_pool, v_pool, cos_sin_cache(), *norm))
        if replay
        else float("nan")
    )
    return [t * 1e3, 100 * tcopy / t, graph, peers.triton_rope_pool_warps()]


def torch_rope(q, k, positions, freqs):
    angle = positions.float()[:, None] * freqs[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]

    def rot(x):
        a, b = x[..., : D // 2].float(), x[..., D // 2 :].float()
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)

    return rot(q), rot(k)


def torch_rope_pool(q, k, v, positions, slots, k_pool, v_pool, freqs):
    q_rot, k_rot = torch_rope(q, k, positions, freqs)
    k_pool.index_copy_(0, slots, k_rot)
    v_pool.index_copy_(0, slots, v)
    return q_rot, k_rot


def _quantized(k_rot, v, k_pool, v_pool, k_scale, v_scale):
    """k_rot and v as the pool stores them: divided by the scale, saturated and cast for fp8 pools."""
    if k_scale is None:
        return k_rot, v
    fmax = torch.finfo(k_pool.dtype).max
    return (
        (k_rot.float() / k_scale).clamp(-fmax, fmax).to(k_pool.dtype),
        (v.float() / v_scale).clamp(-fmax, fmax).to(v_pool.dtype),
    )


def torch_rope_paged(q, k, v, positions, slots, k_pool, v_pool, freqs, layout, page, k_scale, v_scale):
    """The plain composition for a paged (and maybe fp8) cache: rope, quantize, scatter into the page view."""
    q_rot, k_rot = torch_rope(q, k, positions, freqs)
    kr, vr = _quantized(k_rot, v, k_pool, v_pool, k_scale, v_scale)
    pages, offs = slots // page, slots % page
    if layout == "NHD":
        k_pool[pages, offs] = kr
        v_pool[pages, offs] = vr
    else:
        k_pool[pages, :, offs] = kr
        v_pool[pages, :, offs] = vr
    return q_rot, k_rot


def torch_rope_paged_rows(q, k, v, positions, slots, k_pool, v_pool, freqs, layout, page, k_scale, v_scale):
    """The same with index_copy_ into a [rows, head_dim] view of the pool (a row per slot and head)."""
    q_rot, k_rot = torch_rope(q, k, positions, freqs)
    kr, vr = _quantized(k_rot, v, k_pool, v_pool, k_scale, v_scale)
    heads = k.shape[1]
    h = torch.arange(heads, device=slots.device)
    if layout == "NHD":
        rows = slots[:, None] * heads + h[None, :]
    else:
        rows = ((slots // page)[:, None] * heads + h[None, :]) * page + (slots % page)[:, None]
    for pool, x in ((k_pool, kr), (v_pool, vr)):
        if k_scale is not None:  # fp8 moved as bytes, as servers hold fp8 caches (index_copy_ has no fp8 kernel)
            pool, x = pool.view(torch.uint8), x.view(torch.uint8)
        pool.view(-1, D).index_copy_(0, rows.reshape(-1), x.reshape(-1, D))
    return q_rot, k_rot


PAGED_PEERS = {"index_put into the page view": torch_rope_paged, "index_copy_ into pool rows": torch_rope_paged_rows}


def rms_norm_model(x, w, eps):
    """Qwen3's RMSNorm as the model writes it: float32 inside, weight * T(normalized)."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm_f32(x, w, eps):
    """The same norm kept in float32 to the end, one rounding (fewer casts for Inductor)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def torch_norm_rope_pool(q, k, v, positions, slots, k_pool, v_pool, freqs, wq, wk, eps, norm):
    q_rot, k_rot = torch_rope(norm(q, wq, eps), norm(k, wk, eps), positions, freqs)
    k_pool.index_copy_(0, slots, k_rot)
    v_pool.index_copy_(0, slots, v)
    return q_rot, k_rot


def torch_norm_rope_pool_put(q, k, v, positions, slots, k_pool, v_pool, freqs, wq, wk, eps, norm):
    q_rot, k_rot = torch_rope(norm(q, wq, eps), norm(k, wk, eps), positions, freqs)
    k_pool[slots] = k_rot
    v_pool[slots] = v
    return q_rot, k_rot


def fastest_compiled(ms, calls, replay):
    """The compiled formulations at their best: the fastest by kernel time (its name and seconds, from the
    timed loop `ms`) and, where `replay` (small T), the fastest CUDA-graph replay of any of them (us; the
    formulation that launches fewer kernels can replay faster although its kernels take longer)."""
    best, tc, graph_c = "-", float("nan"), float("nan")
    for name, call in calls.items():
        if not ms[name] >= tc:  # tc starts as NaN
            best, tc = name, ms[name]
        graph = common.graph_replay_us(call) if replay else float("nan")
        if not graph >= graph_c:
            graph_c = graph
    return best, tc, graph_c


NORM_PEERS = {
    "model norm, index_copy_": (torch_norm_rope_pool, rms_norm_model),
    "float32 norm, index_put": (torch_norm_rope_pool_put, rms_norm_f32),
}


def run_norm(quick: bool = False, with_peers: bool = True, ts=None):
    """QK norm + RoPE + pool write (Qwen3 geometries), beside RoPE alone on the same data."""
    iters = 10 if quick else 50
    g = torch.Generator(device="cuda").manual_seed(2)
    freqs = inv_freq()
    rows = []
    for hq, hkv in [(32, 8), (64, 8)]:
        k_pool = torch.zeros(POOL, hkv, D, device="cuda", dtype=torch.bfloat16)
        v_pool = torch.zeros_like(k_pool)
        wq = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(torch.bfloat16)
        wk = (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(torch.bfloat16)
        kw = dict(head_dim=D, num_qo_heads=hq, num_kv_heads=hkv, rope_base=BASE)
        nkw = dict(kw, q_norm_weight=wq, k_norm_weight=wk, norm_eps=1e-6)
        for T in ts or ([8, 128, 8192] if quick else [1, 128, 2048, 8192, 32768]):
            nbytes = T * ((hq + 2 * hkv) * D * 2 + 16) + T * (hq + 3 * hkv) * D * 2

            def make():
                return (
                    torch.randn(T, hq, D, device="cuda", dtype=torch.bfloat16, generator=g),
                    torch.randn(T, hkv, D, device="cuda", dtype=torch.bfloat16, generator=g),
                    torch.randn(T, hkv, D, device="cuda", dtype=torch.bfloat16, generator=g),
                    torch.randint(0, MAXPOS, (T,), device="cuda", generator=g),
                    torch.randperm(POOL, device="cuda", generator=g)[:T],
                )

            sets = [make() for _ in range(common.sets_needed(nbytes))]
            small = T <= 128
            calls = {
                "norm": [lambda s=s: attnprep.rope_pool_fused(*s, k_pool, v_pool, **nkw) for s in sets],
                "rope": [lambda s=s: attnprep.rope_pool_fused(*s, k_pool, v_pool, **kw) for s in sets],
                "norm+cache": [
                    lambda s=s: attnprep.rope_pool_fused(*s, k_pool, v_pool, **nkw, cos_sin_cache=cos_sin_cache())
                    for s in sets
                ],
                "copy": common.copy_fns(nbytes // 2),
                "copy+cache": cache_copy_fns(nbytes, T),
            }
            compiled = {}
            if with_peers:
                for name, (fn, norm) in NORM_PEERS.items():
                    comp = peers.compiled_static(fn, *sets[0], k_pool, v_pool, freqs, wq, wk, 1e-6, norm)
                    compiled[name] = (comp, norm)
                    calls[name] = [
                        lambda s=s, comp=comp, norm=norm: comp(*s, k_pool, v_pool, freqs, wq, wk, 1e-6, norm)
                        for s in sets
                    ]
                tri_calls = triton_calls(
                    sets,
                    k_pool,
                    v_pool,
                    lambda s, c: attnprep.rope_pool_fused(*s, k_pool, v_pool, **nkw, cos_sin_cache=c)[:2],
                    (wq, wk),
                )
                if tri_calls is not None:
                    calls["triton"] = tri_calls
            ms = timed(calls, iters)
            t, t_rope, tcopy = ms["norm"], ms["rope"], ms["copy"]
            graph = (
                common.graph_replay_us(lambda: attnprep.rope_pool_fused(*sets[0], k_pool, v_pool, **nkw))
                if small
                else float("nan")
            )
            graph_copy = common.copy_replay_us(nbytes // 2) if small else float("nan")
            cached = through_cache(
                lambda s, c: attnprep.rope_pool_fused(*s, k_pool, v_pool, **nkw, cos_sin_cache=c),
                sets,
                ms["norm+cache"],
                ms["copy+cache"],
                small,
            )
            best, tc, graph_c = fastest_compiled(
                ms,
                {
                    name: (lambda comp=comp, norm=norm: comp(*sets[0], k_pool, v_pool, freqs, wq, wk, 1e-6, norm))
                    for name, (comp, norm) in compiled.items()
                },
                small,
            )
            tri = (
                triton_columns(sets, k_pool, v_pool, ms.get("triton"), ms["copy+cache"], small, (wq, wk))
                if with_peers
                else [float("nan")] * len(TRITON_COLUMNS)
            )
            rows.append(
                [f"{hq}/{hkv}", T, t * 1e3, 100 * tcopy / t, t / t_rope, graph, graph_copy]
                + cached
                + [best, tc * 1e3, graph_c, tc / t, graph_c / graph]
                + tri
            )
    common.print_table(
        f"rope_pool_fused with the QK norm (q_norm_weight, k_norm_weight), bf16, head_dim 128 ({common.environment()})",
        ["heads", "T", "attnprep us", "% of copy", "time / RoPE alone", "graph replay us", "copy graph replay us"]
        + CACHE_COLUMNS
        + ["fastest compiled peer", "torch.compile us", "compile graph us", "speed-up vs compile", "graph speed-up"]
        + TRITON_COLUMNS,
        rows,
    )


def torch_mrope_pool(q, k, v, positions, slots, k_pool, v_pool, freqs, section, interleaved, wq=None, wk=None):
    """transformers' Qwen2.5-VL / Qwen3-VL formulation: cos/sin of every axis's angles, recomposed by
    section (split and concatenated) or interleaved (strided slices of the height and width axes), then the
    rotation (after Qwen3's per-head norm when weights are given) and index_copy_ into the pools."""
    angle = positions.float()[..., None] * freqs  # [3, T, D / 2]
    if interleaved:
        mixed = angle[0].clone()
        for axis in (1, 2):
            mixed[..., axis : 3 * section[axis] : 3] = angle[axis, ..., axis : 3 * section[axis] : 3]
    else:
        mixed = torch.cat([part[i % 3] for i, part in enumerate(angle.split(section, dim=-1))], dim=-1)
    cos, sin = mixed.cos()[:, None, :], mixed.sin()[:, None, :]
    if wq is not None:
        q, k = rms_norm_model(q, wq, 1e-6), rms_norm_model(k, wk, 1e-6)

    def rot(x):
        a, b = x[..., : D // 2].float(), x[..., D // 2 :].float()
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)

    q_rot, k_rot = rot(q), rot(k)
    k_pool.index_copy_(0, slots, k_rot)
    v_pool.index_copy_(0, slots, v)
    return q_rot, k_rot


# name: (mrope_section, interleaved, QK norm)
MROPE_MODELS = {
    "Qwen2.5-VL sections": ([16, 24, 24], False, False),
    "Qwen3-VL interleaved + QK norm": ([24, 20, 20], True, True),
}


def run_mrope(quick: bool = False, with_peers: bool = True, ts=None):
    """M-RoPE + pool write at 32/8 heads (Qwen3-VL-8B's geometry), cos/sin from the table."""
    iters = 10 if quick else 50
    g = torch.Generator(device="cuda").manual_seed(3)
    freqs = inv_freq()
    k_pool = torch.zeros(POOL, HKV, D, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    rows = []
    for name, (section, interleaved, norm) in MROPE_MODELS.items():
        weights = {}
        if norm:
            weights = {
                w: (1 + 0.1 * torch.randn(D, device="cuda", generator=g)).to(torch.bfloat16)
                for w in ("q_norm_weight", "k_norm_weight")
            }
        kw = dict(head_dim=D, num_qo_heads=HQ, num_kv_heads=HKV, rope_base=BASE, cos_sin_cache=cos_sin_cache())
        kw.update(weights)
        mk = dict(kw, mrope_section=section, mrope_interleaved=interleaved)
        wq, wk = weights.get("q_norm_weight"), weights.get("k_norm_weight")
        for T in ts or ([128, 8192] if quick else [1, 128, 2048, 8192]):
            nbytes = T * ((HQ + 2 * HKV) * D * 2 + 32) + T * (HQ + 3 * HKV) * D * 2

            def make():
                q, k, v, _, slots = case(T, g)
                return q, k, v, torch.randint(0, MAXPOS, (3, T), device="cuda", generator=g), slots

            sets = [make() for _ in range(common.sets_needed(nbytes))]
            for s in sets:  # correctness on this data first: the kernel against the gathered rows
                rows_cs = mrope_cos_sin_rows(cos_sin_cache(), s[3], section, interleaved)
                want = attnprep.rope_pool_fused(*s[:3], None, s[4], k_pool, v_pool, **dict(kw, cos_sin_cache=rows_cs))
                got = attnprep.rope_pool_fused(*s, k_pool, v_pool, **mk)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), "M-RoPE differs from its rows"
            small = T <= 128
            calls = {
                "mrope": [lambda s=s: attnprep.rope_pool_fused(*s, k_pool, v_pool, **mk) for s in sets],
                "one": [
                    lambda s=s: attnprep.rope_pool_fused(*s[:3], s[3][0], s[4], k_pool, v_pool, **kw) for s in sets
                ],
                "copy": cache_copy_fns(nbytes, T),
            }
            if with_peers:
                compiled = peers.compiled_static(
                    torch_mrope_pool, *sets[0], k_pool, v_pool, freqs, section, interleaved, wq, wk
                )
                calls["compiled"] = [
                    lambda s=s: compiled(*s, k_pool, v_pool, freqs, section, interleaved, wq, wk) for s in sets
                ]
                for s in sets:
                    want = attnprep.rope_pool_fused(*s, k_pool, v_pool, **mk)[:2]
                    for a, b in zip(compiled(*s, k_pool, v_pool, freqs, section, interleaved, wq, wk), want):
                        err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                        assert err < 2e-2, f"the compiled peer differs from attnprep by {err}"
                if peers.triton is not None:
                    tri = lambda s: peers.triton_rope_pool(  # noqa: E731
                        *s, k_pool, v_pool, cos_sin_cache(), wq, wk, 1e-6, section, interleaved
                    )
                    for s in sets:
                        for a, b in zip(tri(s), attnprep.rope_pool_fused(*s, k_pool, v_pool, **mk)[:2]):
                            err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                            assert err < 2e-2, f"the Triton peer differs from attnprep by {err}"
                    calls["triton"] = [lambda s=s: tri(s) for s in sets]
            ms = timed(calls, iters)
            nan = float("nan")
            t, tcopy = ms["mrope"], ms["copy"]
            tc, tt = ms.get("compiled", nan), ms.get("triton", nan)
            graph = graph_copy = graph_c = graph_t = nan
            if small:
                s = sets[0]
                graph = common.graph_replay_us(lambda: attnprep.rope_pool_fused(*s, k_pool, v_pool, **mk))
                graph_copy = common.copy_replay_us((nbytes + T * D * 4) // 2)
                if "compiled" in calls:
                    graph_c = common.graph_replay_us(calls["compiled"][0])
                if "triton" in calls:
                    graph_t = common.graph_replay_us(calls["triton"][0])
            rows.append(
                [name, T, t * 1e3, 100 * tcopy / t, t / ms["one"], graph, graph_copy]
                + [tc * 1e3, graph_c, tc / t, tt * 1e3, graph_t, tt / t]
            )
    common.print_table(
        f"rope_pool_fused with M-RoPE (positions [3, T], cos_sin_cache), bf16, 32/8 heads, head_dim 128 "
        f"({common.environment()})",
        ["model", "T", "attnprep us", "% of copy", "time / one position", "graph replay us", "copy graph replay us"]
        + ["torch.compile us", "compile graph us", "speed-up vs compile", "Triton us", "Triton graph us"]
        + ["speed-up vs Triton"],
        rows,
    )


# (pool dtype, layout, page size) of the KV-format table
# (pool dtype, layout, page size, q_rot in fp8 with q_scale)
FORMATS = [
    (torch.bfloat16, "NHD", 16, False),
    (torch.float8_e4m3fn, "NHD", 16, False),
    (torch.float8_e4m3fn, "NHD", 16, True),
    (torch.bfloat16, "HND", 64, False),
    (torch.float8_e4m3fn, "HND", 64, False),
]
Q_SCALE = 0.25


def with_fp8_q(fn):
    """A paged peer that also returns q_rot in fp8 (``q_rot / q_scale``, saturated), as attnprep's ``q_scale``."""

    def peer(*args):
        q_rot, k_rot = fn(*args)
        return (q_rot.float() / Q_SCALE).clamp(-448, 448).to(torch.float8_e4m3fn), k_rot

    return peer


def run_formats(quick: bool = False, with_peers: bool = True, ts=None):
    iters = 10 if quick else 50
    g = torch.Generator(device="cuda").manual_seed(1)
    freqs = inv_freq()
    rows = []
    for pool_dtype, layout, page, fp8_q in FORMATS:
        shape = (POOL // page, page, HKV, D) if layout == "NHD" else (POOL // page, HKV, page, D)
        k_pool = torch.zeros(shape, device="cuda", dtype=pool_dtype)
        v_pool = torch.zeros_like(k_pool)
        fp8 = pool_dtype != torch.bfloat16
        scales = dict(k_scale=torch.tensor(0.5, device="cuda"), v_scale=torch.tensor(2.0, device="cuda")) if fp8 else {}
        if fp8_q:
            scales["q_scale"] = torch.tensor(Q_SCALE, device="cuda")
        kw = dict(head_dim=D, num_qo_heads=HQ, num_kv_heads=HKV, rope_base=BASE, kv_layout=layout, **scales)
        pool_bytes, q_rot_bytes = (1 if fp8 else 2), (1 if fp8_q else 2)
        for T in ts or ([128, 8192] if quick else [128, 2048, 8192]):
            # q, k, v, positions, slots read once; q_rot, k_rot written; pool rows written at the pool's size
            written = T * (HQ * q_rot_bytes + HKV * 2) * D + T * 2 * HKV * D * pool_bytes
            nbytes = T * ((HQ + 2 * HKV) * D * 2 + 16) + written
            sets = [case(T, g) for _ in range(common.sets_needed(nbytes))]
            calls = op_and_copy_calls(sets, k_pool, v_pool, kw, nbytes, T)
            compiled = {}
            if with_peers:
                ks, vs = scales.get("k_scale"), scales.get("v_scale")
                args = (k_pool, v_pool, freqs, layout, page, ks, vs)
                for name, fn in PAGED_PEERS.items():
                    comp = peers.compiled_static(with_fp8_q(fn) if fp8_q else fn, *sets[0], *args)
                    for s in sets:  # each formulation writes the pool rows attnprep writes (its own cos/sin
                        # may round a k_rot element the other way: within a bf16 ulp, or one of fp8 once quantized)
                        pg, off = s[4] // page, s[4] % page
                        at = (pg, off) if layout == "NHD" else (pg, slice(None), off)
                        attnprep.rope_pool_fused(*s, k_pool, v_pool, **kw)
                        pools = [pl.view(torch.uint8) for pl in (k_pool, v_pool)]
                        want = [pl[at].clone() for pl in pools]
                        for pl in pools:
                            pl[at] = 0xFF  # poisoned: a formulation that writes nothing fails
                        comp(*s, *args)
                        tol = 0.13 if fp8 else 0.02
                        for pl, w in zip(pools, want):
                            got, ref = pl[at].view(pool_dtype).float(), w.view(pool_dtype).float()
                            assert not got.isnan().any(), f"{name} left pool rows unwritten"
                            assert torch.allclose(got, ref, rtol=tol, atol=tol * ref.abs().max()), name
                    compiled[name] = comp
                    calls[name] = [lambda s=s, comp=comp: comp(*s, *args) for s in sets]
            ms = timed(calls, iters)
            t, tcopy = ms["op"], ms["copy"]
            graph = (
                common.graph_replay_us(lambda: attnprep.rope_pool_fused(*sets[0], k_pool, v_pool, **kw))
                if T <= 128
                else float("nan")
            )
            graph_copy = common.copy_replay_us(nbytes // 2) if T <= 128 else float("nan")
            cached = through_cache(
                lambda s, c: attnprep.rope_pool_fused(*s, k_pool, v_pool, **kw, cos_sin_cache=c),
                sets,
                ms["op+cache"],
                ms["copy+cache"],
                T <= 128,
            )
            best, tc, graph_c = fastest_compiled(
                ms, {name: (lambda comp=comp: comp(*sets[0], *args)) for name, comp in compiled.items()}, T <= 128
            )
            rows.append(
                [
                    f"{str(pool_dtype).replace('torch.', '')} {layout} page {page}" + (", fp8 q" if fp8_q else ""),
                    T,
                    t * 1e3,
                    100 * tcopy / t,
                    graph,
                    graph_copy,
                ]
                + cached
                + [best, tc * 1e3, graph_c, tc / t]
            )
        k_pool = v_pool = None  # freed before the next format's pools
    common.print_table(
        f"rope_pool_fused into paged and fp8 caches, bf16 q/k/v, 32/8 heads, head_dim 128 ({common.environment()})",
        ["pool", "T", "attnprep us", "% of copy", "graph replay us", "copy graph replay us"]
        + CACHE_COLUMNS
        + ["fastest compiled peer", "torch.compile us", "compile graph us", "speed-up vs compile"],
        rows,
    )


def case(T, g):
    q = torch.randn(T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(T, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(T, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    positions = torch.randint(0, MAXPOS, (T,), device="cuda", generator=g)
    slots = torch.randperm(POOL, device="cuda", generator=g)[:T]
    return q, k, v, positions, slots


def run(quick: bool = False, ts=None, with_peers: bool = True):
    iters = 10 if quick else 50
    g = torch.Generator(device="cuda").manual_seed(0)
    k_pool = torch.randn(POOL, HKV, D, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.randn(POOL, HKV, D, device="cuda", dtype=torch.bfloat16)
    freqs = inv_freq()
    kw = dict(head_dim=D, num_qo_heads=HQ, num_kv_heads=HKV, rope_base=BASE)
    rows = []
    for T in ts or ([128, 8192] if quick else TS):
        nbytes = T * ((HQ + 2 * HKV) * D * 2 + 16) + T * (HQ + 3 * HKV) * D * 2
        sets = [case(T, g) for _ in range(common.sets_needed(nbytes))]
        for s in sets:  # correctness on this data first
            q_rot, k_rot, _, _ = attnprep.rope_pool_fused(*s, k_pool, v_pool, **kw)
            assert torch.equal(k_pool[s[4]], k_rot) and torch.equal(v_pool[s[4]], s[2]), "pool mismatch"
            ref_q = torch_rope(s[0], s[1], s[3], freqs)[0]
            err = ((q_rot.float() - ref_q.float()).abs().max() / ref_q.float().abs().max()).item()
            assert err < 2e-2, f"q_rot differs from the plain-PyTorch composition by {err}"
        calls = op_and_copy_calls(sets, k_pool, v_pool, kw, nbytes, T)
        if with_peers:
            compiled = peers.compiled_static(torch_rope_pool, *sets[0], k_pool, v_pool, freqs)
            calls["eager"] = [lambda s=s: torch_rope_pool(*s, k_pool, v_pool, freqs) for s in sets]
            calls["compiled"] = [lambda s=s: compiled(*s, k_pool, v_pool, freqs) for s in sets]
            tri_calls = triton_calls(
                sets,
                k_pool,
                v_pool,
                lambda s, c: attnprep.rope_pool_fused(*s, k_pool, v_pool, **kw, cos_sin_cache=c)[:2],
            )
            if tri_calls is not None:
                calls["triton"] = tri_calls
        ms = timed(calls, iters)
        t, tcopy = ms["op"], ms["copy"]
        te, tc = ms.get("eager", float("nan")), ms.get("compiled", float("nan"))
        cached = through_cache(
            lambda s, c: attnprep.rope_pool_fused(*s, k_pool, v_pool, **kw, cos_sin_cache=c),
            sets,
            ms["op+cache"],
            ms["copy+cache"],
            T <= 512,
        )
        graph = graph_off = graph_c = graph_copy = float("nan")
        if T <= 512:
            s = sets[0]
            graph_copy = common.copy_replay_us(nbytes // 2)
            graph = common.graph_replay_us(lambda: attnprep.rope_pool_fused(*s, k_pool, v_pool, **kw))
            with common.pdl(False):
                graph_off = common.graph_replay_us(lambda: attnprep.rope_pool_fused(*s, k_pool, v_pool, **kw))
            if with_peers:
                graph_c = common.graph_replay_us(lambda: compiled(*s, k_pool, v_pool, freqs))
        tri = (
            triton_columns(sets, k_pool, v_pool, ms.get("triton"), ms["copy+cache"], T <= 512)
            if with_peers
            else [float("nan")] * len(TRITON_COLUMNS)
        )
        rows.append(
            [T, t * 1e3, common.gbps(nbytes, t), 100 * tcopy / t, graph, graph_off, graph_copy]
            + cached
            + [tc * 1e3, 100 * tcopy / tc, graph_c, te * 1e3, tc / t]
            + tri
        )
    common.print_table(
        f"rope_pool_fused, bf16, 32/8 heads, head_dim 128 ({common.environment()}, "
        f"PDL available: {common.pdl_available()})",
        ["T", "attnprep us", "GB/s", "% of copy", "graph replay us", "graph replay, PDL off us", "copy graph replay us"]
        + CACHE_COLUMNS
        + ["torch.compile us", "compile % of copy", "compile graph us", "eager us", "speed-up vs compile"]
        + TRITON_COLUMNS,
        rows,
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--ts",
        type=lambda s: [int(x) for x in s.split(",")],
        help="token counts of every table run, e.g. 1,128,8192 (default: each table's own)",
    )
    p.add_argument("--no-peers", action="store_true", help="attnprep only (tuning runs)")
    p.add_argument("--only", choices=["rope", "formats", "norm", "mrope"], help="one table")
    a = p.parse_args()
    if a.only in (None, "rope"):
        run(a.quick, a.ts, not a.no_peers)
    if a.only in (None, "formats"):
        run_formats(a.quick, not a.no_peers, a.ts)
    if a.only in (None, "norm"):
        run_norm(a.quick, not a.no_peers, a.ts)
    if a.only in (None, "mrope"):
        run_mrope(a.quick, not a.no_peers, a.ts)
