"""Benchmark mla_rope_pool_fused at DeepSeek-V3's geometry per tensor-parallel rank against the model's own
formulation and a Triton kernel of the kind servers ship.

    python bench/bench_mla_rope_pool.py [--quick] [--no-peers]

16 heads of 128 + 64, latent 512 + 64, bf16; kv_c and k_pe slices of the kv projection's output [T, 576]; the
YaRN table of the model (float32); q's rope part and k_pe rotated in place (as servers call it), kv_c normalized,
[kv_c | k_pe] into a paged latent cache (page 64) of bf16 or fp8 e4m3. Per shape, one interleaved loop: attnprep;
a device copy of the same bytes (q's rope part and k_pe read and written, kv_c read, the cache rows written, the
table rows read); transformers' DeepSeek-V3 formulation (kv_a_layernorm, apply_rotary_pos_emb_interleave, the row
into the page view) compiled per shape (static); the Triton peer (bf16 caches); CUDA-graph replay where T <= 128.
"""

from __future__ import annotations

import argparse

import attnprep
import peers
import torch
from attnprep import _bench as common

H, NOPE, R, L = 16, 128, 64, 512
PAGE, POOL = 64, 40960  # cache slots
SCALING = dict(
    rope_type="yarn",
    factor=40.0,
    original_max_position_embeddings=4096,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=1.0,
)


def model_formulation(q, kv_c, k_pe, positions, slots, cache, table, w, eps, scale):
    """DeepSeek-V3 as transformers writes it: DeepseekV3RMSNorm of kv_c, apply_rotary_pos_emb_interleave (pairs
    de-interleaved, rotate_half) on q's rope part (in place) and k_pe, the row [kv_c | k_pe] into the page view
    (divided by the scale and cast for fp8 pages)."""
    x = kv_c.float()
    kv = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(kv_c.dtype)
    half = R // 2
    cos, sin = table[positions].split(half, -1)
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)

    def rope(x, c, s):
        x = x.unflatten(-1, (half, 2)).transpose(-1, -2).flatten(-2).float()
        return x * c + torch.cat([-x[..., half:], x[..., :half]], -1) * s

    q[..., NOPE:] = rope(q[..., NOPE:], cos[:, None], sin[:, None]).to(q.dtype)
    k_rot = rope(k_pe, cos, sin).to(k_pe.dtype)
    row = torch.cat([kv, k_rot], -1)
    if scale is not None:
        row = (row.float() / scale).clamp(-448, 448).to(cache.dtype)
    cache[slots // PAGE, slots % PAGE] = row
    return q, k_rot


def deinterleaved(x):
    """GPT-J pairs as the model lays its rotated values out (first elements, then second ones)."""
    return x.unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2)


def inputs(T, g):
    q = torch.randn(T, H, NOPE + R, device="cuda", generator=g).to(torch.bfloat16)
    kv = torch.randn(T, L + R, device="cuda", generator=g).to(torch.bfloat16)
    positions = torch.randint(0, 163840, (T,), device="cuda", generator=g)
    slots = torch.randperm(POOL, device="cuda", generator=g)[:T]
    return q, kv[:, :L], kv[:, L:], positions, slots


def run(quick: bool = False, with_peers: bool = True):
    iters = 10 if quick else 50
    g = torch.Generator(device="cuda").manual_seed(1)
    table = attnprep.rope_cos_sin_cache(R, 163840, 1e4, scaling=SCALING, device="cuda")
    w = (1 + 0.1 * torch.randn(L, device="cuda", generator=g)).to(torch.bfloat16)
    rows = []
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        fp8 = cache_dtype != torch.bfloat16
        cache = torch.zeros(POOL // PAGE, PAGE, L + R, device="cuda", dtype=cache_dtype)
        scale = torch.tensor(0.5, device="cuda") if fp8 else None
        kw = dict(cos_sin_cache=table, kv_norm_weight=w, cache_scale=scale, inplace=True)
        for T in [128, 8192] if quick else [1, 32, 128, 2048, 8192, 32768]:
            nbytes = T * (2 * H * R * 2 + L * 2 + 2 * R * 2 + 16 + (L + R) * cache.element_size() + R * 4)
            sets = [inputs(T, g) for _ in range(common.sets_needed(nbytes))]
            calls = {
                "op": [lambda s=s: attnprep.mla_rope_pool_fused(*s, cache, **kw) for s in sets],
                "copy": common.copy_fns(nbytes // 2),
            }
            if with_peers:
                q, kv_c, k_pe, positions, slots = (x.clone() for x in sets[0])
                got = attnprep.mla_rope_pool_fused(q.clone(), kv_c, k_pe.clone(), positions, slots, cache, **kw)
                want = model_formulation(q.clone(), kv_c, k_pe.clone(), positions, slots, cache, table, w, 1e-6, scale)
                for a, b in (
                    (deinterleaved(got[0][..., NOPE:]), want[0][..., NOPE:]),
                    (deinterleaved(got[1]), want[1]),
                ):
                    assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2), "the model's formulation differs"
                compiled = peers.compiled_static(model_formulation, *sets[0], cache, table, w, 1e-6, scale)
                calls["compiled"] = [lambda s=s: compiled(*s, cache, table, w, 1e-6, scale) for s in sets]
                if not fp8 and peers.triton is not None:
                    tri = peers.triton_mla_rope_pool(q.clone(), kv_c, k_pe.clone(), positions, slots, cache, table, w)
                    for a, b in zip(tri, got[:2]):
                        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2), "the Triton peer differs"
                    calls["triton"] = [lambda s=s: peers.triton_mla_rope_pool(*s, cache, table, w) for s in sets]
            ms = dict(zip(calls, common.median_ms_interleaved(list(calls.values()), iters)))
            nan = float("nan")
            t, tc, tt = ms["op"], ms.get("compiled", nan), ms.get("triton", nan)
            graph = graph_copy = graph_c = graph_t = nan
            if T <= 128:
                graph = common.graph_replay_us(calls["op"][0])
                graph_copy = common.copy_replay_us(nbytes // 2)
                if with_peers:
                    graph_c = common.graph_replay_us(calls["compiled"][0])
                    if "triton" in calls:
                        graph_t = common.graph_replay_us(calls["triton"][0])
            rows.append(
                [str(cache_dtype).replace("torch.", ""), T, t * 1e3, common.gbps(nbytes, t), 100 * ms["copy"] / t]
                + [graph, graph_copy, tc * 1e3, graph_c, tc / t, tt * 1e3, graph_t, tt / t]
            )
        cache = None
    common.print_table(
        f"mla_rope_pool_fused, DeepSeek-V3 per rank: 16 heads of 128 + 64, latent 512 + 64, bf16, YaRN table, "
        f"in place, paged cache ({common.environment()})",
        ["cache", "T", "attnprep us", "GB/s", "% of copy", "graph replay us", "copy graph replay us"]
        + ["torch.compile us", "compile graph us", "speed-up vs compile", "Triton us", "Triton graph us"]
        + ["speed-up vs Triton"],
        rows,
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-peers", action="store_true", help="attnprep only")
    a = p.parse_args()
    run(a.quick, not a.no_peers)
