"""The Ulysses send side of a diffusion transformer on one GPU: the layer's fused prologue pass (QK norm + RoPE +
pack into the send buffer, one kernel) against the chains it replaces and a device copy of its bytes.

    python bench/bench_ulysses_send.py

Per rank: Wan 2.1-14B at 720p on 8 ranks (B = 1, S = 9450, 40 heads x 128, the QK norm over all heads) and Flux at
1024^2 on 2 ranks (S = 2304 of 4608 image tokens, 24 heads x 128, per-head norm), batch 1 and 2; bf16, q, k, v
slices of one fused projection output, cos/sin rows shared by the batch (GPT-J pairs). Contenders, in one
interleaved loop: the fused pass (and the same pass writing e4m3 wire rows); attnprep's chain (qk_norm_rope, then
the layer's grouped pack); diffusers' formulation (torch's RMSNorm and apply_rotary_emb's real form) then the same
pack, eager; the whole chain in torch compiled per shape (static); a copy of the bytes (q, k, v read once, the send
buffer written once, the rows read once per token). Every contender's send buffer is checked against the fused
pass's first.
"""

from __future__ import annotations

import attnprep
import peers
import torch
from attnprep import _C, qk_norm_rope
from attnprep import _bench as common
from bench_qk_norm_rope import diffusers_norm_rope

SHAPES = [  # (model, B, S, heads, world, norm over)
    ("Wan 2.1-14B 720p / 8 ranks", 1, 9450, 40, 8, "token"),
    ("Flux 1024^2 / 2 ranks", 1, 2304, 24, 2, "head"),
    ("Flux 1024^2 batch 2 / 2 ranks", 2, 2304, 24, 2, "head"),
]
D = 128


def pack(q, k, v, world):
    """The layer's grouped pack of [B, S, H, D] q, k, v (read as [S, B, H, D] views) -> [world, S, B, n * D]."""
    B, S = q.shape[:2]
    send = _C._pack_qkv_gqa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), world, 1)[0]
    return send.view(world, S, B, -1)


def torch_chain(q, k, v, wq, wk, cos, sin, world):
    """diffusers' norm and RoPE, then the destination-major pack, all in torch (for torch.compile)."""
    q, k = diffusers_norm_rope(q, k, wq, wk, cos, sin)
    B, S, H, _ = q.shape
    parts = [t.reshape(B, S, world, H // world, D) for t in (q, k, v)]
    return torch.cat(parts, dim=3).permute(2, 1, 0, 3, 4).reshape(world, S, B, -1)


def run():
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for model, B, S, H, world, norm in SHAPES:
        angle = torch.rand(S, D // 2, device="cuda", generator=g) * 100
        cos, sin = angle.cos().repeat_interleave(2, 1)[:, None], angle.sin().repeat_interleave(2, 1)[:, None]
        table = attnprep.rope_cos_sin_rows(cos[:, 0], sin[:, 0])
        n = D if norm == "head" else H * D
        wq, wk = ((1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(torch.bfloat16) for _ in range(2))
        nbytes = 2 * (3 * B * S * H * D * 2) + S * D * 4
        sets = []
        for _ in range(common.sets_needed(nbytes)):
            fused = torch.randn(B, S, 3 * H * D, device="cuda", generator=g).to(torch.bfloat16)
            sets.append(tuple(t.unflatten(-1, (H, D)) for t in fused.split(H * D, dim=-1)))
        kw = dict(cos_sin_cache=table, is_neox=False, q_norm_weight=wq, k_norm_weight=wk)

        def one_pass(q, k, v):
            return _C._ulysses_send(q, k, v, world, wq, wk, 1e-6, 0.0, table, None, D, False)

        row_bytes = _C._wire_row_bytes(3 * H // world, D)

        def one_pass_fp8(q, k, v):  # the same pass writing e4m3 wire rows (the layer allocates them per call)
            wire = torch.empty(world, S, B, row_bytes, dtype=torch.uint8, device="cuda")
            return _C._ulysses_send(q, k, v, world, wq, wk, 1e-6, 0.0, table, None, D, False, 1, wire)

        def chain(q, k, v):
            return pack(*qk_norm_rope(q, k, **kw), v, world)

        def model_chain(q, k, v):
            return pack(*diffusers_norm_rope(q, k, wq, wk, cos, sin), v, world)

        compiled = peers.compiled_static(torch_chain, *sets[0], wq, wk, cos, sin, world)
        want = one_pass(*sets[0]).view(world, S, B, -1)
        assert torch.equal(chain(*sets[0]), want), "the fused pass differs from qk_norm_rope + pack"
        others = {"diffusers": model_chain(*sets[0]), "compiled": compiled(*sets[0], wq, wk, cos, sin, world)}
        for name, got in others.items():
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            assert err < 2e-2, f"{name} chain differs from the fused pass by {err}"
        calls = {
            "fused": [lambda s=s: one_pass(*s) for s in sets],
            "fp8": [lambda s=s: one_pass_fp8(*s) for s in sets],
            "chain": [lambda s=s: chain(*s) for s in sets],
            "diffusers": [lambda s=s: model_chain(*s) for s in sets],
            "compiled": [lambda s=s: compiled(*s, wq, wk, cos, sin, world) for s in sets],
            "copy": common.copy_fns(nbytes // 2),
        }
        ms = dict(zip(calls, common.median_ms_interleaved(list(calls.values()), iters=30)))
        t = ms["fused"]
        row = [model, f"{B} x {S}", H, norm, t * 1e3, 100 * ms["copy"] / t, ms["fp8"] * 1e3]
        for peer in ("chain", "diffusers", "compiled"):
            row += [ms[peer] * 1e3, ms[peer] / t]
        rows.append(row)
    header = ["shape", "B x S", "heads", "norm over", "fused us", "% of copy", "fused, e4m3 wire us"]
    for peer in ("attnprep chain", "diffusers + pack", "torch.compile"):
        header += [f"{peer} us", "x"]
    title = f"Ulysses send side: QK norm + RoPE + pack, bf16, head_dim {D} ({common.environment()})"
    common.print_table(title, header, rows)


if __name__ == "__main__":
    run()
