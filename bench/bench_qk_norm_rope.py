"""Benchmark qk_norm_rope at diffusion-transformer shapes against diffusers' own formulation.

    python bench/bench_qk_norm_rope.py [--quick]

q and k are slices of one fused projection [B, S, 3 * H * 128] (bf16), the
RMSNorm weights bf16 (per head, or over all heads for Wan), cos/sin one
float32 row per token shared by the batch (GPT-J pairs). Per shape, in one interleaved loop
(common.median_ms_interleaved): attnprep; a device copy of the same bytes (q
and k read, q_rot and k_rot written, the rows read once); diffusers'
formulation (torch's RMSNorm, then apply_rotary_emb's real form) eager and
compiled per shape (static); CUDA-graph replay where S is small.
"""

from __future__ import annotations

import argparse

import attnprep
import peers
import torch
from attnprep import _bench as common

D = 128
# name, B, S, heads, norm over: "head" (Flux, HunyuanVideo, Qwen-Image) or "token" (all heads: Wan)
SHAPES = [
    ("Flux 1024^2", 1, 4608, 24, "head"),
    ("Flux 512^2, batch 2", 2, 1536, 24, "head"),
    ("Wan 2.1-1.3B 480p", 1, 32760, 12, "token"),
    ("small", 1, 256, 24, "head"),
]


def diffusers_norm_rope(q, k, wq, wk, cos, sin):
    """diffusers: torch.nn.RMSNorm per head (a weight of head_dim) or over all heads (Wan: heads * head_dim), then
    apply_rotary_emb (adjacent pairs, float32, one rounding)."""

    def rope(x):
        x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
        x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
        return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)

    def norm(x, w):
        if w.numel() == D:
            return torch.nn.functional.rms_norm(x, (D,), w, 1e-6)
        return torch.nn.functional.rms_norm(x.flatten(-2), (w.numel(),), w, 1e-6).unflatten(-1, x.shape[-2:])

    return rope(norm(q, wq)), rope(norm(k, wk))


def inputs(B, S, H, g):
    qkv = torch.randn(B, S, 3 * H * D, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, _ = (t.unflatten(-1, (H, D)) for t in qkv.split(H * D, dim=-1))
    return q, k


def run(quick: bool = False, with_peers: bool = True):
    iters = 10 if quick else 50
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, B, S, H, over in SHAPES[:1] if quick else SHAPES:
        angle = torch.arange(S, device="cuda")[:, None] * 1e4 ** -torch.linspace(0, 1, D // 2, device="cuda")
        cos, sin = angle.cos().repeat_interleave(2, 1)[:, None], angle.sin().repeat_interleave(2, 1)[:, None]
        table = attnprep.rope_cos_sin_rows(cos[:, 0], sin[:, 0])
        n = D if over == "head" else H * D
        wq, wk = ((1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(torch.bfloat16) for _ in range(2))
        nbytes = 2 * (2 * B * S * H * D * 2) + S * D * 4
        sets = [inputs(B, S, H, g) for _ in range(common.sets_needed(nbytes))]
        kw = dict(cos_sin_cache=table, is_neox=False, q_norm_weight=wq, k_norm_weight=wk)
        for q, k in sets:  # correctness on this data first
            for a, b in zip(attnprep.qk_norm_rope(q, k, **kw), diffusers_norm_rope(q, k, wq, wk, cos, sin)):
                err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                assert err < 2e-2, f"qk_norm_rope differs from diffusers' formulation by {err}"
        calls = {
            "op": [lambda s=s: attnprep.qk_norm_rope(*s, **kw) for s in sets],
            "copy": common.copy_fns(nbytes // 2),
        }
        if with_peers:
            compiled = peers.compiled_static(diffusers_norm_rope, *sets[0], wq, wk, cos, sin)
            calls["compiled"] = [lambda s=s: compiled(*s, wq, wk, cos, sin) for s in sets]
            calls["eager"] = [lambda s=s: diffusers_norm_rope(*s, wq, wk, cos, sin) for s in sets]
        ms = dict(zip(calls, common.median_ms_interleaved(list(calls.values()), iters)))
        nan = float("nan")
        t, tc, te = ms["op"], ms.get("compiled", nan), ms.get("eager", nan)
        graph = graph_c = nan
        if S <= 256:
            graph = common.graph_replay_us(calls["op"][0])
            if with_peers:
                graph_c = common.graph_replay_us(calls["compiled"][0])
        rows.append(
            [name, f"{B} x {S}", H, over, t * 1e3, common.gbps(nbytes, t), 100 * ms["copy"] / t, graph]
            + [tc * 1e3, graph_c, tc / t, te * 1e3]
        )
    common.print_table(
        f"qk_norm_rope, bf16, head_dim 128, QK norm + GPT-J rows ({common.environment()})",
        ["shape", "B x S", "heads", "norm over", "attnprep us", "GB/s", "% of copy", "graph replay us"]
        + ["torch.compile us", "compile graph us", "speed-up vs compile", "diffusers eager us"],
        rows,
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-peers", action="store_true", help="attnprep only")
    a = p.parse_args()
    run(a.quick, not a.no_peers)
