"""rope_pool_fused alone, for A/B runs (tools/gpu_ab.sh): kernel time, % of a
copy of the same bytes and CUDA-graph replay per call, for RoPE alone, the QK
norm (32/8, 64/8 and 16/8 heads; Gemma's offset weights with 32/8) and fp8 pages,
at T = 1 ... 8192 (bf16, head_dim 128; --tokens, --cases pick others), with
cos/sin from rope_base and from a float32 cos_sin_cache. --triton adds the
Triton peer of bench/peers.py on the same data (cache cases in q's dtype,
not Gemma's weights) and the warp count its autotuner chose, to compare
time against T with it; attnprep, the copy and the peer timed in one
interleaved loop; bench/bench_rope_pool.py makes the tables."""

import argparse
import os
import sys

import torch

import attnprep
from attnprep import _bench as common

D, POOL = 128, 1 << 20
CASES = [("rope", 32, False, False), ("rope64", 64, False, False), ("norm", 32, False, True), ("norm64", 64, False, True),
         ("norm16", 16, False, True), ("gemma", 32, False, True), ("fp8", 32, True, False)]
# gemma: the QK norm with Gemma's (1 + w); norm16: 16/8 heads, a token of two rounds of 128 items (32/8: three, 64/8: five)
MAXPOS = 131072


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cos-sin", choices=["rope_base", "cache", "both"], default="both", help="where cos/sin come from")
    ap.add_argument("--tokens", default="1,128,512,2048,8192", help="comma-separated token counts")
    ap.add_argument("--cases", default=",".join(c[0] for c in CASES), help="comma-separated cases to run")
    ap.add_argument("--triton", action="store_true", help="also time the Triton peer (bench/peers.py)")
    a = ap.parse_args()
    peers = None
    if a.triton:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
        import peers
    token_counts = [int(x) for x in a.tokens.split(",")]
    cases = [c for c in CASES if c[0] in a.cases.split(",")]
    sources = {"rope_base": (False,), "cache": (True,), "both": (False, True)}[a.cos_sin]
    g = torch.Generator(device="cuda").manual_seed(0)

    def inputs(T, hq, hkv):
        return (torch.randn(T, hq, D, device="cuda", dtype=torch.bfloat16, generator=g),
                torch.randn(T, hkv, D, device="cuda", dtype=torch.bfloat16, generator=g),
                torch.randn(T, hkv, D, device="cuda", dtype=torch.bfloat16, generator=g),
                torch.randint(0, MAXPOS, (T,), device="cuda", generator=g),
                torch.randperm(POOL, device="cuda", generator=g)[:T])

    rows = []
    table = attnprep.rope_cos_sin_cache(D, MAXPOS, 1e4, device="cuda")
    for (name, hq, fp8, norm), cache in [(c, x) for x in sources for c in cases]:
        hkv = 8
        if fp8:
            k_pool = torch.zeros(POOL // 16, 16, hkv, D, device="cuda", dtype=torch.float8_e4m3fn)
            extra = dict(k_scale=torch.tensor(0.5, device="cuda"), v_scale=torch.tensor(2.0, device="cuda"))
        else:
            k_pool = torch.zeros(POOL, hkv, D, device="cuda", dtype=torch.bfloat16)
            extra = {}
        v_pool = torch.zeros_like(k_pool)
        if norm:
            extra = dict(q_norm_weight=torch.rand(D, device="cuda", dtype=torch.bfloat16) + 0.5,
                         k_norm_weight=torch.rand(D, device="cuda", dtype=torch.bfloat16) + 0.5)
            if name == "gemma":
                extra["norm_weight_offset"] = 1.0
        kw = dict(head_dim=D, num_qo_heads=hq, num_kv_heads=hkv, rope_base=1e4, **extra)
        if cache:
            kw["cos_sin_cache"] = table
            name += "+cache"
        pool_bytes = 1 if fp8 else 2
        for T in token_counts:
            nbytes = T * ((hq + 2 * hkv) * D * 2 + 16) + T * (hq + hkv) * D * 2 + T * 2 * hkv * D * pool_bytes
            sets = [inputs(T, hq, hkv) for _ in range(common.sets_needed(nbytes))]
            contenders = [[lambda s=s: attnprep.rope_pool_fused(*s, k_pool, v_pool, **kw) for s in sets],
                          common.copy_fns(nbytes // 2)]
            peer = peers is not None and peers.triton is not None and cache and not fp8 and name != "gemma+cache"
            if peer:
                norm_w = (extra["q_norm_weight"], extra["k_norm_weight"]) if norm else ()
                call = lambda s: peers.triton_rope_pool(*s, k_pool, v_pool, table, *norm_w)  # noqa: E731
                contenders.append([lambda s=s: call(s) for s in sets])
            # one interleaved loop (common.median_ms_interleaved says why)
            times = common.median_ms_interleaved(contenders, 50)
            t, t_copy = times[0], times[1]
            replay = common.graph_replay_us(lambda: attnprep.rope_pool_fused(*sets[0], k_pool, v_pool, **kw)) \
                if T <= 512 else float("nan")
            rows.append([name, T, t * 1e3, 100 * t_copy / t, replay, ""])
            if peer:
                t = times[2]
                replay = common.graph_replay_us(lambda: call(sets[0])) if T <= 512 else float("nan")
                rows.append(["triton:" + name, T, t * 1e3, 100 * t_copy / t, replay, peers.triton_rope_pool_warps()])
    common.print_table("rope_pool_fused alone (A/B)", ["case", "T", "us", "% of copy", "graph replay us", "warps"],
                       rows)


if __name__ == "__main__":
    main()
