"""The batched layer's prologue: ``ulysses_attention(..., prologue=kw)`` must equal the layer on
``qk_norm_rope(q, k, **kw)``'s outputs, bit for bit (the fused send pass is bit for bit the chain it replaces, and
attention then reads the same bytes); a bad prologue on any rank raises the same error on every rank."""

import pytest
import torch
from attnprep import qk_norm_rope, ulysses
from attnprep.ulysses import prologue as prologue_module
from conftest import error_text, gloo_case_reports, nccl_ranks_ok

KEYS = ", ".join(ulysses.PROLOGUE_KEYS) + " and text_norm"


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
    w = torch.ones(16)
    if case == "text form":
        kw = dict(kw, q_norm_weight=w, k_norm_weight=w, text_norm=(w, w))
    if case == "text weight":  # a weight that is no tensor would leave the text rows unnormalized
        kw = dict(kw, q_norm_weight=w, k_norm_weight=w, text_norm=(2, w, None))
    if case == "text rows":
        kw = dict(kw, q_norm_weight=w, k_norm_weight=w, text_norm=(6 if rank == 0 else 2, w, w))
    if case == "text needs":
        kw = dict(kw, text_norm=(2, w, w))
    return error_text(lambda: ulysses.ulysses_attention(q, k, v, prologue=kw))


ERRORS = [
    # rank 0 passes none, and raises rank 1's error rather than waiting for it
    ("one rank", "ValueError: ulysses: rank 1: rope_pool_fused expects CUDA or MPS tensors"),
    ("key", f"TypeError: ulysses: rank 1: ulysses: prologue takes qk_norm_rope's {KEYS}, got 'inplace'"),
    ("type", "TypeError: ulysses: rank 0: ulysses: prologue must be a dict or None, got list"),
    ("3-D", f"ValueError: ulysses: rank 0: {ulysses.PROLOGUE_NEEDS_BATCH}"),
    ("CPU", "ValueError: ulysses: rank 0: rope_pool_fused expects CUDA or MPS tensors"),
    ("text form", f"TypeError: ulysses: rank 0: {prologue_module.TEXT_NORM_FORM.format('tuple')}"),
    ("text weight", f"TypeError: ulysses: rank 0: {prologue_module.TEXT_NORM_FORM.format('tuple')}"),
    ("text rows", f"ValueError: ulysses: rank 0: {prologue_module.TEXT_NORM_ROWS.format(5, 6)}"),
    ("text needs", f"ValueError: ulysses: rank 0: {prologue_module.TEXT_NORM_NEEDS}"),
]


@pytest.mark.parametrize("case, message", ERRORS)
def test_every_rank_raises_the_same_error(case, message):
    got, codes = gloo_case_reports(_errors_body, 2, [c for c, _ in ERRORS], case)
    assert got == [(0, message), (1, message)], got
    assert codes == [0, 0]


def _inputs(B, S, H, Hkv, D, dtype, norm, rope, partial, seed, text=0):
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
    if text:
        q_text, k_text = (torch.rand_like(kw[key]) + 0.5 for key in ("q_norm_weight", "k_norm_weight"))
        kw["text_norm"] = (text, q_text, k_text)
    return q, k, v, kw


def _reference_rotation(q, k, kw):
    """qk_norm_rope's q_rot and k_rot; with text_norm, of its two row ranges with their own weights (the tables of
    the text cases: shared rows, or positions)."""
    if "text_norm" not in kw:
        return qk_norm_rope(q, k, **kw)
    (rows, q_text, k_text), rest = kw["text_norm"], {key: kw[key] for key in kw if key != "text_norm"}
    parts = []
    for lo, hi, extra in ((0, rows, dict(q_norm_weight=q_text, k_norm_weight=k_text)), (rows, q.shape[1], {})):
        part = dict(rest, **extra)
        if "positions" in part:
            part["positions"] = part["positions"][:, lo:hi]
        else:
            part["cos_sin_cache"] = part["cos_sin_cache"][lo:hi]
        parts.append(qk_norm_rope(q[:, lo:hi], k[:, lo:hi], **part))
    return tuple(torch.cat([parts[0][i], parts[1][i]], dim=1) for i in (0, 1))


E4M3 = torch.float8_e4m3fn
# (B, S, H, Hkv, D, dtype, norm, rope, partial, chunks, wire_dtype, fused)
GPU_CASES = [
    (2, 64, 24, 24, 128, torch.bfloat16, "head", "shared_rows", False, 1, None, True),  # Flux
    (1, 95, 40, 40, 128, torch.bfloat16, "token", "token_rows", False, 1, None, True),  # Wan, one rank's rows
    (2, 33, 8, 2, 64, torch.float16, "head", "positions", True, 1, None, True),  # GQA, a table and positions
    (2, 17, 4, 4, 64, torch.float32, "none", "shared_rows", False, 1, None, True),
    (2, 17, 6, 6, 96, torch.bfloat16, "head", "shared_rows", False, 1, None, False),  # head_dim 96: the chain
    (2, 17, 8, 8, 64, torch.bfloat16, "token", "shared_rows", False, 2, None, False),  # chunks: the chain
    (2, 64, 24, 24, 128, torch.bfloat16, "token", "shared_rows", False, 1, E4M3, True),  # fp8 wire
    (2, 33, 8, 2, 64, torch.float32, "head", "positions", True, 1, torch.float8_e5m2, True),
    # joint text + image rows with their own norm weights (Flux's double-stream blocks, Qwen-Image)
    (2, 40, 24, 24, 128, torch.bfloat16, "head", "shared_rows", False, 1, None, True, 9),
    (2, 40, 6, 6, 96, torch.bfloat16, "head", "shared_rows", False, 1, None, False, 9),  # the two-part chain
    (2, 33, 8, 2, 64, torch.float32, "head", "positions", True, 1, None, True, 33),
    (2, 64, 24, 24, 128, torch.bfloat16, "head", "shared_rows", False, 1, E4M3, True, 5),
]


def _equal_body(rank, world, device, cases):
    taken = []
    fused_send = prologue_module._fused_send

    def recorded(*args):
        send = fused_send(*args)
        taken.append(send is not None)
        return send

    prologue_module._fused_send = recorded
    failures = []
    for i, (B, S, H, Hkv, D, dtype, norm, rope, partial, chunks, wire, fused, *text) in enumerate(cases):
        q, k, v, kw = _inputs(B, S, H, Hkv, D, dtype, norm, rope, partial, i, *text)
        taken.clear()
        got = ulysses.ulysses_attention(q, k, v, chunks=chunks, wire_dtype=wire, prologue=kw)
        q_rot, k_rot = _reference_rotation(q, k, kw)
        want = ulysses.ulysses_attention(q_rot, k_rot, v, chunks=chunks, wire_dtype=wire)
        if wire is None and not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            failures.append(f"case {i}: differs by {(got.float() - want.float()).abs().max().item()}")
        # with a wire format attention meets the same dequantized values in another buffer layout
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        if wire is not None and err > (1e-5 if dtype == torch.float32 else 1e-2):
            failures.append(f"case {i}: relative difference {err}")
        if any(taken) != fused:
            failures.append(f"case {i}: the fused pass ran: {taken}, expected {fused}")
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
