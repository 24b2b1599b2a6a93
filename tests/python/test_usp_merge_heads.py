"""usp_merge_heads against x.permute(2, 1, 0, 3, 4).contiguous() (docs/contract.md)."""

import pytest
import torch
from attnprep import usp_merge_heads
from conftest import requires_cuda, same_bits


def reference(x):
    return x.permute(2, 1, 0, 3, 4).contiguous()


def raises(msg, x):
    with pytest.raises(ValueError) as e:
        usp_merge_heads(x)
    assert str(e.value) == msg


def test_messages_reachable_on_cpu():
    raises(
        "usp_merge_heads expects x to be 5-D [W, S, B, h_local, D], got torch.Size([2, 3, 4, 5])",
        torch.randn(2, 3, 4, 5),
    )
    raises("usp_merge_heads expects a CUDA tensor", torch.randn(2, 3, 1, 4, 8))


def test_outputs_past_int64_bytes_are_refused():
    """Check 4 on fake CUDA tensors (no GPU needed): an expanded x of 2^62 elements."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        one = torch.empty(1, 1, 1, 1, 1, device="cuda")
        raises("x is too large: the output would exceed 2^63 - 1 bytes", one.expand(1 << 31, 1 << 31, 1, 1, 1))
        assert usp_merge_heads(one.expand(1 << 20, 1 << 20, 1, 1, 1)).shape == (1, 1 << 20, 1 << 20, 1, 1)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float8_e4m3fn, torch.int8], ids=str)
def test_unsupported_dtype(dtype):
    x = torch.zeros(2, 3, 1, 4, 8, device="cuda").to(dtype)
    raises(f"Unsupported usp_merge_heads dtype: {dtype}", x)


@requires_cuda
def test_unsupported_dtype_exact_text():
    raises(
        "Unsupported usp_merge_heads dtype: torch.float64",
        torch.zeros(1, 1, 1, 1, 1, device="cuda", dtype=torch.float64),
    )


SHAPES = [(8, 65, 1, 3, 128), (2, 17, 2, 5, 80), (3, 1, 1, 1, 64), (4, 33, 3, 2, 17), (1, 7, 2, 4, 1)]


@requires_cuda
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "permuted", "last_dim_strided", "offset"])
def test_matches_permute(shape, dtype, layout):
    w, s, b, h, d = shape
    if layout == "contiguous":
        x = torch.randn(shape, device="cuda").to(dtype)
    elif layout == "permuted":  # a view of a [S, B, W, h, D] buffer
        x = torch.randn(s, b, w, h, d, device="cuda").to(dtype).permute(2, 0, 1, 3, 4)
    elif layout == "last_dim_strided":
        x = torch.randn(w, s, b, h, 2 * d, device="cuda").to(dtype)[..., ::2]
    else:  # storage offset by one element: no 16-byte vectors
        x = torch.randn(w * s * b * h * d + 1, device="cuda").to(dtype)[1:].view(shape)
    got = usp_merge_heads(x)
    assert got.is_contiguous()
    assert same_bits(got, reference(x))


@requires_cuda
def test_empty():
    x = torch.empty(2, 0, 1, 3, 8, device="cuda", dtype=torch.float16)
    assert usp_merge_heads(x).shape == (1, 0, 2, 3, 8)


@requires_cuda
def test_cuda_graph_and_compile():
    x = torch.randn(4, 65, 2, 3, 64, device="cuda", dtype=torch.bfloat16)
    usp_merge_heads(x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = usp_merge_heads(x)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert same_bits(y, reference(x))
    f = torch.compile(lambda t: usp_merge_heads(t * 2) + 1, fullgraph=True)
    assert torch.equal(f(x), reference(x * 2) + 1)
    torch.library.opcheck(torch.ops.attnprep.usp_merge_heads.default, (x,))
