"""The batched layer's prologue: ``ulysses_attention(..., prologue=kw)`` must equal the layer on
``qk_norm_rope(q, k, **kw)``'s outputs, bit for bit; a bad prologue on any rank raises the same error on every
rank."""

import pytest
import torch
from attnprep import qk_norm_rope, ulysses
from conftest import nccl_ranks_ok, run_rank, spawn_ranks

KEYS = ", ".join(ulysses.PROLOGUE_KEYS)


def _errors_body(rank, world, device, case):
    q = torch.randn(2, 5, 4, 16)
    k = v = torch.randn(2, 5, 2, 16)
    table = torch.randn(5, 16)
    kw = dict(cos_sin_cache=table)
    if case == "one rank" and rank == 0:
        kw = None
    if case == "key":
        kw = None if rank == 0 else dict(kw, inplace=True)
    if case == "type":
        kw = [table]
    if case == "3-D":
        q, k, v = q[0], k[0], v[0]
    try:
        ulysses.ulysses_attention(q, k, v, prologue=kw)
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize(
    "case, message",
    [
        # rank 0 passes none, and raises rank 1's error rather than waiting for it
        ("one rank", "ValueError: ulysses: rank 1: rope_pool_fused expects CUDA or MPS tensors"),
        ("key", f"TypeError: ulysses: rank 1: ulysses: prologue takes qk_norm_rope's {KEYS}, got 'inplace'"),
        ("type", "TypeError: ulysses: rank 0: ulysses: prologue must be a dict or None, got list"),
        ("3-D", f"ValueError: ulysses: rank 0: {ulysses.PROLOGUE_NEEDS_BATCH}"),
        ("CPU", "ValueError: ulysses: rank 0: rope_pool_fused expects CUDA or MPS tensors"),
    ],
)
def test_every_rank_raises_the_same_error(case, message):
    got, codes = spawn_ranks(run_rank, 2, "gloo", _errors_body, case, timeout=120)
    assert got == [(0, message), (1, message)], got
    assert codes == [0, 0]


def _inputs(B, S, H, Hkv, D, dtype, norm, rope, partial, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    fused = torch.randn(B, S, (H + 2 * Hkv) * D, device="cuda", generator=g).to(dtype)  # one projection's output
    q, k, v = (t.unflatten(-1, (-1, D)) for t in fused.split([H * D, Hkv * D, Hkv * D], dim=-1))
    rotary_dim = D // 2 if partial else D
    rows = {"shared_rows": S, "token_rows": B * S, "positions": 512}[rope]
    angle = torch.rand(rows, rotary_dim // 2, device="cuda", generator=g) * 100
    kw = dict(cos_sin_cache=torch.cat([angle.cos(), angle.sin()], dim=1), rotary_dim=rotary_dim)
    if rope == "positions":
        kw["positions"] = torch.randint(0, rows, (B, S), device="cuda", generator=g)
        kw["is_neox"] = False
    if norm != "none":
        kw["q_norm_weight"] = torch.rand(D if norm == "head" else H * D, device="cuda", generator=g) + 0.5
        kw["k_norm_weight"] = torch.rand(D if norm == "head" else Hkv * D, device="cuda", generator=g) + 0.5
    return q, k, v, kw


# (B, S, H, Hkv, D, dtype, norm, rope, partial, chunks, wire_dtype)
GPU_CASES = [
    (2, 64, 24, 24, 128, torch.bfloat16, "head", "shared_rows", False, 1, None),  # Flux
    (1, 95, 40, 40, 128, torch.bfloat16, "token", "token_rows", False, 1, None),  # Wan, one rank's rows
    (2, 33, 8, 2, 64, torch.float16, "head", "positions", True, 1, None),  # GQA, a table and positions, partial
    (2, 17, 4, 4, 64, torch.float32, "none", "shared_rows", False, 1, None),
    (2, 17, 6, 6, 96, torch.bfloat16, "head", "shared_rows", False, 1, None),
    (2, 17, 8, 8, 64, torch.bfloat16, "token", "shared_rows", False, 2, None),  # chunks
    (2, 64, 24, 24, 128, torch.bfloat16, "token", "shared_rows", False, 1, torch.float8_e4m3fn),  # fp8 wire
    (2, 33, 8, 2, 64, torch.float32, "head", "positions", True, 1, torch.float8_e5m2),
]


def _equal_body(rank, world, device, cases):
    failures = []
    for i, (B, S, H, Hkv, D, dtype, norm, rope, partial, chunks, wire) in enumerate(cases):
        q, k, v, kw = _inputs(B, S, H, Hkv, D, dtype, norm, rope, partial, seed=i)
        got = ulysses.ulysses_attention(q, k, v, chunks=chunks, wire_dtype=wire, prologue=kw)
        q_rot, k_rot = qk_norm_rope(q, k, **kw)
        want = ulysses.ulysses_attention(q_rot, k_rot, v, chunks=chunks, wire_dtype=wire)
        if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            failures.append(f"case {i}: differs by {(got.float() - want.float()).abs().max().item()}")
    # a bad argument meets qk_norm_rope's own message, whichever path would have run
    q, k, v, kw = _inputs(2, 17, 4, 4, 64, torch.bfloat16, "head", "shared_rows", False, 0)
    for bad, message in [
        (dict(kw, norm_eps=-1.0), "norm_eps must be a positive finite number, got -1"),
        (dict(kw, rotary_dim=17), "rope_pool_fused expects an even rotary_dim in [2, head_dim], got 17"),
    ]:
        try:
            ulysses.ulysses_attention(q, k, v, prologue=bad)
            failures.append(f"no error for {message}")
        except ValueError as e:
            if str(e) != f"ulysses: rank 0: {message}":
                failures.append(f"got {e}")
    return "; ".join(failures) or "ok"


def test_the_prologue_equals_qk_norm_rope_then_the_layer_nccl():
    nccl_ranks_ok(1, _equal_body, GPU_CASES)
