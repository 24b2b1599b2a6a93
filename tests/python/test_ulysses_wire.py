"""fp8 on the Ulysses wire: the format's round trip, and the layer's output
against float64 attention over the whole sequence (gloo ranks here; NCCL
where GPUs are), every rank agreeing on the wire dtype."""

import attnprep
import pytest
import torch
from attnprep import ulysses
from attnprep.testing import attention_reference
from conftest import assert_ranks_ok, nccl_ranks_ok, run_rank

WIRES = {torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}  # half an ulp at the top of the format, relative


@pytest.mark.parametrize("wire", list(WIRES), ids=str)
def test_wire_round_trip(wire):
    x = torch.randn(3, 5, 3, 64, dtype=torch.bfloat16) * torch.logspace(-3, 3, 3)[None, None, :, None]
    x[0, 0, 0] = 0  # an all-zero block
    buf = ulysses.wire._to_wire(x, wire)
    # fp8 values, then float32 scales, then zeros to a multiple of 16 bytes
    assert buf.dtype == torch.uint8 and buf.shape == (3, 5, 3 * 64 + 3 * 4 + 4)
    assert not buf[..., -4:].any()
    y = ulysses.wire._from_wire(buf, 3, 64, wire, x.dtype)
    block_max = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-30)
    assert ((y.float() - x.float()).abs() / block_max).max().item() <= WIRES[wire] + 2**-8  # + bf16 output rounding
    assert torch.equal(y[0, 0, 0], x[0, 0, 0])


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
KERNEL_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _special_blocks(x: torch.Tensor) -> torch.Tensor:
    """Poisons a few (row, head) blocks of [rows, heads, D]: zeros, a NaN, an inf, tiny and huge values."""
    x = x.clone()
    if x.numel() == 0:
        return x
    x[0, 0] = 0
    if x.shape[0] > 1:
        x[1, 0, 3] = float("nan")
    if x.shape[0] > 2:
        x[2, -1, 0] = float("inf")
    x[-1, -1] *= 1e-37 if x.dtype != torch.float16 else 1e-4  # bf16 and float32: fmax / amax overflows
    x[-1, 0] *= 1e4 if x.dtype != torch.float16 else 10
    return x


@needs_cuda
@pytest.mark.parametrize("wire", list(WIRES), ids=str)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize(
    "world,rows,heads,kv,dim",
    [
        (1, 1, 2, 2, 64),
        (2, 17, 8, 8, 128),
        (3, 5, 6, 6, 32),
        (2, 65, 8, 4, 128),
        (4, 3, 8, 2, 64),
        (2, 9, 4, 1, 256),
        (2, 0, 4, 4, 128),
    ],
)
def test_fused_pack_quantize_matches_torch_byte_for_byte(wire, dtype, world, rows, heads, kv, dim):
    """The CUDA pack + quantize kernel writes exactly the bytes of the plain
    torch protocol (pack, then _to_wire), padding included, over a poisoned buffer."""
    g = torch.Generator().manual_seed(rows * 100 + heads)
    q, k, v = (_special_blocks(torch.randn(rows, n, dim, generator=g).to(dtype)).cuda() for n in (heads, kv, kv))
    shape, n = ulysses.exchange._send_layout(q, k, world)
    want = ulysses.wire._to_wire(ulysses.exchange._pack(q, k, v, world).view(world, rows, n, dim), wire)
    got = torch.full_like(want, 0xA5)
    assert attnprep._C._wire_pack_qkv(q, k, v, world, ulysses.agreement._WIRE[wire], got)
    assert torch.equal(got, want)


@needs_cuda
@pytest.mark.parametrize("wire", list(WIRES), ids=str)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("world,rows,heads,dim", [(1, 1, 1, 16), (2, 17, 3, 128), (3, 65, 4, 64), (2, 0, 2, 64)])
def test_quantize_and_dequantize_strided_views_match_torch(wire, dtype, world, rows, heads, dim):
    """The output side: an attention output laid out [h, S, D] (as SDPA
    returns it, transposed), quantized as it lies; and the received bytes
    dequantized straight into the merged [rows, W * h, D], every other element
    of a poisoned output left alone."""
    g = torch.Generator().manual_seed(rows + heads)
    o = _special_blocks(torch.randn(heads, world * rows, dim, generator=g).to(dtype).transpose(0, 1)).cuda()
    o = o.transpose(0, 1).contiguous().transpose(0, 1)  # [S, h, D] with the head stride outermost
    x = o.reshape(world, rows, heads, dim)
    assert not x.is_contiguous() or rows * heads == 0 or heads == 1
    want = ulysses.wire._to_wire(x.contiguous(), wire)
    got = torch.full_like(want, 0x5A)
    assert attnprep._C._wire_quantize(x, ulysses.agreement._WIRE[wire], got)
    assert torch.equal(got, want)

    poison = torch.full((rows, world * heads + 1, dim), 7.0, dtype=dtype, device="cuda")
    target = poison[:, 1:].view(rows, world, heads, dim).permute(1, 0, 2, 3)
    assert attnprep._C._wire_dequantize(want, ulysses.agreement._WIRE[wire], target)
    ref = ulysses.wire._from_wire(want, heads, dim, wire, dtype)
    # equal values, NaN where the reference has NaN (its payload bits may differ)
    assert torch.equal(target.float().nan_to_num(12345.0), ref.float().nan_to_num(12345.0))
    assert torch.equal(target.isnan(), ref.isnan())
    assert (poison[:, 0] == 7).all()


@needs_cuda
@pytest.mark.parametrize("wire", list(WIRES), ids=str)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_every_block_maximum_gets_the_divided_scale(wire, dtype):
    """The kernel's scale (amax times fmax's rounded reciprocal, one FMA
    correction) is IEEE division's: every positive finite 16-bit value as a
    block's largest magnitude (either sign), and for float32 a sweep of the
    whole range and of the tiny blocks where the inverse overflows or the
    scale falls below float32's normals."""
    g = torch.Generator().manual_seed(7)
    if dtype == torch.float32:
        bits = torch.randint(1, 0x7F800000, (1 << 18,), generator=g, dtype=torch.int64)
        tiny = torch.randint(0x03800000, 0x07800000, (1 << 16,), generator=g, dtype=torch.int64)  # 8e-37 - 2e-34
        top = torch.cat([bits, tiny]).to(torch.int32).view(torch.float32)
    else:
        top = torch.arange(1, 0x7F80 if dtype == torch.bfloat16 else 0x7C00, dtype=torch.int16).view(dtype)
    dim = 32 // dtype.itemsize
    x = (torch.rand(top.numel(), dim, generator=g) * 2 - 1).to(dtype) * top[:, None]  # |x| <= |top|
    x[:, 0] = top
    x[1::2, 0] *= -1
    x = x.view(1, -1, 1, dim).cuda()
    want = ulysses.wire._to_wire(x, wire)
    got = torch.full_like(want, 0xA5)
    assert attnprep._C._wire_quantize(x, ulysses.agreement._WIRE[wire], got)
    assert torch.equal(got, want)


@needs_cuda
def test_where_the_kernels_do_not_apply_the_torch_path_gives_the_same_layer():
    """head_dim 96 (192-byte blocks), head_dim 8 (16 bytes) and a strided
    head_dim: the kernels decline, touching nothing, and the layer's
    functions fall back to torch."""
    for dim in (96, 8):
        x = torch.randn(2, 3, 4, dim, device="cuda", dtype=torch.bfloat16)
        buf = torch.full((2, 3, attnprep._C._wire_row_bytes(4, dim)), 0xA5, dtype=torch.uint8, device="cuda")
        assert not attnprep._C._wire_quantize(x, 1, buf)
        assert (buf == 0xA5).all()
        assert not attnprep._C._wire_dequantize(ulysses.wire._to_wire(x, torch.float8_e4m3fn), 1, x)
    strided = torch.randn(2, 3, 4, 128, 2, device="cuda", dtype=torch.bfloat16)[..., 0]
    buf = torch.empty((2, 3, attnprep._C._wire_row_bytes(4, 128)), dtype=torch.uint8, device="cuda")
    assert not attnprep._C._wire_quantize(strided, 1, buf)
    assert torch.equal(
        ulysses.wire._quantize(strided, torch.float8_e4m3fn),
        ulysses.wire._to_wire(strided.contiguous(), torch.float8_e4m3fn),
    )


def test_wire_errors():
    with pytest.raises(ValueError) as e:
        ulysses.agreement._wire_code(torch.bfloat16)
    assert str(e.value) == "ulysses: wire_dtype must be None, torch.float8_e4m3fn or torch.float8_e5m2"
    with pytest.raises(ValueError) as e:
        ulysses.agreement._wire_code(torch.float8_e4m3fn, 2)
    assert str(e.value) == "ulysses: wire_dtype needs chunks=1"


# the layer's output error against float64 attention, relative to max |v|:
# measured over these shapes (head_dim 32, random normal inputs, world 1-3)
# at most 0.066 (e4m3) and 0.108 (e5m2); the bounds leave half as much again
LAYER_BOUND = {torch.float8_e4m3fn: 0.1, torch.float8_e5m2: 0.16}


def _layer(rank, world, device):
    rows, dim, worst = 6, 32, {}
    # float64 takes the plain-torch protocol; bfloat16 on CUDA the wire kernels
    dtypes = [torch.float64] + ([torch.bfloat16] if torch.device(device).type == "cuda" else [])
    for heads, kv in [(4 * world, 4 * world), (4 * world, world), (2 * world, 1)]:
        for causal, dtype in ((c, d) for c in (False, True) for d in dtypes):
            g = torch.Generator().manual_seed(heads + kv)
            q, k, v = (torch.randn(world * rows, n, dim, generator=g).to(dtype) for n in (heads, kv, kv))
            mine = slice(rank * rows, (rank + 1) * rows)
            want = attention_reference(q.double(), k.double(), v.double(), causal)[mine]
            for wire, bound in LAYER_BOUND.items():
                got = ulysses.ulysses_attention(
                    *(t[mine].to(device) for t in (q, k, v)), causal=causal, wire_dtype=wire
                ).cpu()
                err = ((got.double() - want).abs().max() / v.double().abs().max()).item()
                worst[wire] = max(worst.get(wire, 0.0), err)
                if not err <= bound:
                    return f"({heads}, {kv}, causal {causal}, {dtype}) {wire}: error {err:.3g} > {bound}"
    # ranks that disagree on the wire dtype all raise
    q, k, v = (torch.randn(rows, n, dim, dtype=torch.float64, device=device) for n in (4 * world, world, world))
    wire = torch.float8_e4m3fn if rank == 0 else None
    try:
        ulysses.ulysses_attention(q, k, v, wire_dtype=wire)
        if world > 1:
            return "no error for disagreeing wire dtypes"
    except ValueError as e:
        want = (
            "ulysses: every rank must pass the same wire_dtype, got [torch.float8_e4m3fn, "
            + ", ".join("None" for _ in range(world - 1))
            + "]"
        )
        if str(e) != want:
            return str(e)
    print(
        f"rank {rank}: fp8 wire, worst output error / max |v|: " + ", ".join(f"{w}: {e:.3g}" for w, e in worst.items())
    )
    return "ok"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_gloo_layer_with_fp8_on_the_wire(world):
    assert_ranks_ok(run_rank, world, "gloo", _layer)


@pytest.mark.parametrize("world", [2])
def test_nccl_layer_with_fp8_on_the_wire(world):
    nccl_ranks_ok(world, _layer)
