"""The one-pass Ulysses send side (internal `_C._ulysses_send`): q and k normalized and rotated, q, k and v
packed into the send buffer [world, S, B, n * D] with rows (s, b). Its reference is the chain it replaces, run by
attnprep's own GPU-verified ops: qk_norm_rope, then the grouped pack of [S, B, H, D] views; the results must be
bit for bit equal."""

import pytest
import torch
from attnprep import _C, qk_norm_rope

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# (2, 3, 64, 64, 128, 8) in 2 bytes: q, k and v past the kernel's 48 KB of shared memory, v read straight from memory
SHAPES = [
    (1, 17, 40, 40, 128, 8), (2, 33, 24, 24, 128, 2), (2, 5, 12, 4, 64, 4), (3, 9, 8, 1, 128, 2), (1, 1, 4, 4, 32, 1),
    (2, 3, 64, 64, 128, 8),
]  # fmt: skip


def chain(q, k, v, world, qw, kw, eps, offset, cos_sin, positions, rotary_dim, is_neox):
    q_rot, k_rot = qk_norm_rope(
        q, k, positions, cos_sin_cache=cos_sin, rotary_dim=rotary_dim, is_neox=is_neox,
        q_norm_weight=qw, k_norm_weight=kw, norm_eps=eps, norm_weight_offset=offset,
    )  # fmt: skip
    send = _C._pack_qkv_gqa(q_rot.transpose(0, 1), k_rot.transpose(0, 1), v.transpose(0, 1), world, 1)[0]
    B, S = q.shape[:2]
    return send.view(world, S, B, -1)


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("B, S, H, Hkv, D, world", SHAPES)
@pytest.mark.parametrize("norm", ["none", "head", "token"])
@pytest.mark.parametrize("rope", ["shared_rows", "token_rows", "positions"])
@pytest.mark.parametrize("is_neox", [False, True], ids=["gptj", "neox"])
@pytest.mark.parametrize("partial", [False, True], ids=["full", "half"])
def test_equals_the_chain(dtype, B, S, H, Hkv, D, world, norm, rope, is_neox, partial):
    g = torch.Generator(device="cuda").manual_seed(B * 1000 + S)
    fused = torch.randn(B, S, (H + 2 * Hkv) * D, device="cuda", generator=g).to(dtype)  # one projection's output
    q, k, v = (t.unflatten(-1, (-1, D)) for t in fused.split([H * D, Hkv * D, Hkv * D], dim=-1))
    rotary_dim = D // 2 if partial else D
    rows = {"shared_rows": S, "token_rows": B * S, "positions": 4096}[rope]
    angle = torch.rand(rows, rotary_dim // 2, device="cuda", generator=g) * 100
    cos_sin = torch.cat([angle.cos(), angle.sin()], dim=1)
    positions = torch.randint(0, rows, (B, S), device="cuda", generator=g) if rope == "positions" else None
    qw = kw = None
    if norm != "none":
        qw = torch.rand(D if norm == "head" else H * D, device="cuda", generator=g) + 0.5
        kw = torch.rand(D if norm == "head" else Hkv * D, device="cuda", generator=g) + 0.5
    args = (q, k, v, world, qw, kw, 1e-6, 0.0, cos_sin, positions, rotary_dim, is_neox)
    if H * D * q.element_size() // 16 > 1024:  # past the kernel's registers: refused (the layer keeps the chain)
        with pytest.raises(ValueError, match="at most 1024 16-byte groups of q or k per row"):
            _C._ulysses_send(*args)
        return
    want = chain(*args)
    got = _C._ulysses_send(*args)
    assert got.shape == want.shape
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("B, S, H, Hkv, D, world", SHAPES[:3])
@pytest.mark.parametrize("norm", ["head", "token"])
@pytest.mark.parametrize("is_neox", [False, True], ids=["gptj", "neox"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_weights_in_the_inputs_dtype_equal_the_chain(dtype, B, S, H, Hkv, D, world, norm, is_neox, offset):
    """Norm weights in q's dtype (as models keep them), with and without an offset: bit for bit the chain."""
    g = torch.Generator(device="cuda").manual_seed(B * 100 + H)
    fused = torch.randn(B, S, (H + 2 * Hkv) * D, device="cuda", generator=g).to(dtype)
    q, k, v = (t.unflatten(-1, (-1, D)) for t in fused.split([H * D, Hkv * D, Hkv * D], dim=-1))
    angle = torch.rand(S, D // 2, device="cuda", generator=g) * 100
    cos_sin = torch.cat([angle.cos(), angle.sin()], dim=1)
    qw, kw = (
        (torch.randn(D if norm == "head" else h * D, device="cuda", generator=g) * 0.3).to(dtype) for h in (H, Hkv)
    )
    args = (q, k, v, world, qw, kw, 1e-6, offset, cos_sin, None, D, is_neox)
    want = chain(*args)
    got = _C._ulysses_send(*args)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@CUDA
@pytest.mark.parametrize("B, S, H, world, norm", [(1, 9450, 40, 8, "token"), (1, 2304, 24, 2, "head")])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("wire_dtype", [None, torch.float8_e4m3fn], ids=str)
def test_model_sized_grids_equal_the_chain(B, S, H, world, norm, weight_dtype, wire_dtype):
    """Wan 2.1-14B 720p / 8 and Flux 1024^2 / 2 per rank: thousands of blocks resident at once, where a block
    reading shared memory that another of its threads wrote without a barrier shows; bit for bit the chain (its
    fp8 wire rows byte for byte)."""
    from attnprep.ulysses.agreement import _WIRE
    from attnprep.ulysses.wire import _quantize

    D = 128
    g = torch.Generator(device="cuda").manual_seed(S)
    fused = torch.randn(B, S, 3 * H * D, device="cuda", generator=g).to(torch.bfloat16)
    q, k, v = (t.unflatten(-1, (H, D)) for t in fused.split(H * D, dim=-1))
    angle = torch.rand(S, D // 2, device="cuda", generator=g) * 100
    cos_sin = torch.cat([angle.cos(), angle.sin()], dim=1)
    n = D if norm == "head" else H * D
    qw, kw = ((1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(weight_dtype) for _ in range(2))
    args = (q, k, v, world, qw, kw, 1e-6, 0.0, cos_sin, None, D, False)
    want = chain(*args)
    if wire_dtype is None:
        got = _C._ulysses_send(*args)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        return
    want = _quantize(want.reshape(world, S * B, want.shape[3] // D, D), wire_dtype)
    wire = torch.full((world, S, B, want.shape[2]), 0x5A, dtype=torch.uint8, device="cuda")  # poisoned
    got = _C._ulysses_send(*args, _WIRE[wire_dtype], wire)
    assert torch.equal(got.view(world, S * B, -1), want)


@CUDA
@pytest.mark.parametrize("wire_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("B, S, H, Hkv, D, world", SHAPES)
@pytest.mark.parametrize("norm, rope, is_neox", [("token", "shared_rows", False), ("head", "positions", True)])
def test_fp8_wire_rows_equal_the_chain_quantized(wire_dtype, dtype, B, S, H, Hkv, D, world, norm, rope, is_neox):
    """With a wire format the pass writes the fp8 wire rows of the chain's send buffer, byte for byte."""
    from attnprep.ulysses.agreement import _WIRE
    from attnprep.ulysses.wire import _quantize

    g = torch.Generator(device="cuda").manual_seed(S * 7 + H)
    fused = torch.randn(B, S, (H + 2 * Hkv) * D, device="cuda", generator=g).to(dtype) * 3
    q, k, v = (t.unflatten(-1, (-1, D)) for t in fused.split([H * D, Hkv * D, Hkv * D], dim=-1))
    rows = S if rope == "shared_rows" else 4096
    angle = torch.rand(rows, D // 2, device="cuda", generator=g) * 100
    cos_sin = torch.cat([angle.cos(), angle.sin()], dim=1)
    positions = torch.randint(0, rows, (B, S), device="cuda", generator=g) if rope == "positions" else None
    qw = torch.rand(D if norm == "head" else H * D, device="cuda", generator=g) + 0.5
    kw = torch.rand(D if norm == "head" else Hkv * D, device="cuda", generator=g) + 0.5
    args = (q, k, v, world, qw, kw, 1e-6, 0.0, cos_sin, positions, D, is_neox)
    if H * D * q.element_size() // 16 > 1024:
        return  # refused, as above
    plain = chain(*args)
    n = plain.shape[3] // D
    want = _quantize(plain.reshape(world, S * B, n, D), wire_dtype)
    wire = torch.full((world, S, B, want.shape[2]), 0x5A, dtype=torch.uint8, device="cuda")  # poisoned
    got = _C._ulysses_send(*args, _WIRE[wire_dtype], wire)
    assert got.data_ptr() == wire.data_ptr()
    assert torch.equal(got.view(world, S * B, -1), want)


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("B, S, H, Hkv, D, world", [(2, 17, 24, 24, 128, 2), (1, 9, 8, 4, 64, 4)])
@pytest.mark.parametrize("text_rows", [1, 7, "all"])
@pytest.mark.parametrize("norm", ["head", "token"])
@pytest.mark.parametrize("rope", ["shared_rows", "token_rows", "positions"])
@pytest.mark.parametrize("wire_dtype", [None, torch.float8_e4m3fn], ids=str)
def test_text_rows_take_their_own_weights(dtype, B, S, H, Hkv, D, world, text_rows, norm, rope, wire_dtype):
    """Joint text + image rows: the first text_rows rows of each sequence are normalized with the text weights,
    the rest with the others; bit for bit the chain run on the two parts (GPT-J pairs, as Flux and Qwen-Image)."""
    from attnprep.ulysses.agreement import _WIRE
    from attnprep.ulysses.wire import _quantize

    text_rows = S if text_rows == "all" else text_rows
    g = torch.Generator(device="cuda").manual_seed(text_rows * 31 + S)
    fused = torch.randn(B, S, (H + 2 * Hkv) * D, device="cuda", generator=g).to(dtype)
    q, k, v = (t.unflatten(-1, (-1, D)) for t in fused.split([H * D, Hkv * D, Hkv * D], dim=-1))
    rows = {"shared_rows": S, "token_rows": B * S, "positions": 512}[rope]
    angle = torch.rand(rows, D // 2, device="cuda", generator=g) * 100
    cos_sin = torch.cat([angle.cos(), angle.sin()], dim=1)
    positions = torch.randint(0, rows, (B, S), device="cuda", generator=g) if rope == "positions" else None
    weights = [torch.rand(D if norm == "head" else h * D, device="cuda", generator=g) + 0.5 for h in (H, Hkv, H, Hkv)]
    parts = []
    for lo, hi, qw, kw in ((0, text_rows, *weights[2:]), (text_rows, S, *weights[:2])):
        table = cos_sin if rope == "positions" else cos_sin[lo:hi]
        if rope == "token_rows":
            table = cos_sin.view(B, S, -1)[:, lo:hi].flatten(0, 1)
        pos = None if positions is None else positions[:, lo:hi]
        parts.append(qk_norm_rope(q[:, lo:hi], k[:, lo:hi], pos, cos_sin_cache=table, is_neox=False,
                                  q_norm_weight=qw, k_norm_weight=kw))  # fmt: skip
    q_rot, k_rot = (torch.cat([parts[0][i], parts[1][i]], dim=1) for i in (0, 1))
    want = _C._pack_qkv_gqa(q_rot.transpose(0, 1), k_rot.transpose(0, 1), v.transpose(0, 1), world, 1)[0]
    args = (q, k, v, world, *weights[:2], 1e-6, 0.0, cos_sin, positions, D, False)
    text = dict(text_rows=text_rows, q_text_weight=weights[2], k_text_weight=weights[3])
    if wire_dtype is None:
        got = _C._ulysses_send(*args, **text)
        assert torch.equal(got.view(torch.uint8), want.view(world, S, B, -1).view(torch.uint8))
    else:
        want = _quantize(want.reshape(world, S * B, -1, D), wire_dtype)
        wire = torch.full((world, S, B, want.shape[2]), 0x5A, dtype=torch.uint8, device="cuda")
        got = _C._ulysses_send(*args, _WIRE[wire_dtype], wire, **text)
        assert torch.equal(got.view(world, S * B, -1), want)


@CUDA
@pytest.mark.parametrize("unaligned", ["table", "weight"])
def test_tables_and_weights_off_16_bytes_are_refused_and_the_prologue_keeps_the_chain(unaligned):
    """The pass reads cos/sin and norm weights 16 bytes at a time: a table or a weight that does not start on 16
    bytes is refused, and the layer's prologue then runs qk_norm_rope, with its results."""
    from attnprep.ulysses.prologue import send_side

    B, S, H, D, world = 2, 9, 8, 64, 2
    g = torch.Generator(device="cuda").manual_seed(5)
    fused = torch.randn(B, S, 3 * H * D, device="cuda", generator=g).to(torch.bfloat16)
    q, k, v = (t.unflatten(-1, (H, D)) for t in fused.split(H * D, dim=-1))
    angle = torch.rand(S, D // 2, device="cuda", generator=g) * 100
    table = torch.cat([angle.cos(), angle.sin()], dim=1)
    weight = torch.rand(D, device="cuda", generator=g) + 0.5
    if unaligned == "table":  # one float past an aligned start
        table = torch.cat([torch.zeros(1, device="cuda"), table.flatten()])[1:].view(S, D)
    else:
        weight = torch.cat([torch.zeros(1, device="cuda"), weight])[1:]
    args = (q, k, v, world, weight, weight, 1e-6, 0.0, table, None, D, False)
    with pytest.raises(ValueError) as e:
        _C._ulysses_send(*args)
    assert str(e.value) == "ulysses_send: cos_sin rows, half rows and norm weights must start on 16 bytes"
    prologue = dict(cos_sin_cache=table, q_norm_weight=weight, k_norm_weight=weight, is_neox=False)
    q_out, k_out, send = send_side(q, k, v, prologue, world, True)
    want = qk_norm_rope(q, k, **prologue)
    assert send is None
    assert torch.equal(q_out, want[0]) and torch.equal(k_out, want[1])
