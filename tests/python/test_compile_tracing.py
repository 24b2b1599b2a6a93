"""torch.compile(fullgraph=True) traces every op through its torch.library
registration and fake implementation, on any machine: with CPU tensors the
graph is built (no graph break) and the real op then raises the documented
ValueError from inside the compiled code."""

import pytest
import torch

import attnprep


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


def expect(msg, fn, *args):
    with pytest.raises(ValueError) as e:
        fn(*args)
    assert str(e.value) == msg


def test_pack_qkv_traces():
    def f(q, k, v):
        return attnprep.pack_qkv_destination_major(q * 2, k, v, 2) + 1

    def f_out(q, k, v, out):
        attnprep.pack_qkv_destination_major(q, k, v, 2, out=out)
        return out * 2

    q = torch.randn(5, 4, 8)
    expect("q, k, and v must be CUDA tensors", compiled(f), q, q, q)
    expect("q, k, and v must be CUDA tensors", compiled(f_out), q, q, q, torch.empty(2, 5, 2, 24))


def test_usp_merge_heads_traces():
    expect("usp_merge_heads expects a CUDA tensor", compiled(lambda x: attnprep.usp_merge_heads(x + 1)),
           torch.randn(2, 3, 1, 4, 8))


@pytest.mark.parametrize("inplace", [False, True])
def test_rope_pool_traces(inplace):
    def f(q, k, v, positions, slots, k_pool, v_pool):
        out = attnprep.rope_pool_fused(q * 1, k * 1, v, positions, slots, k_pool, v_pool, head_dim=64,
                                       num_qo_heads=8, num_kv_heads=2, rope_base=1e4, inplace=inplace)
        return out[0] + 1, out[1].sum()

    args = (torch.randn(4, 8, 64), torch.randn(4, 2, 64), torch.randn(4, 2, 64), torch.arange(4), torch.arange(4),
            torch.zeros(16, 2, 64), torch.zeros(16, 2, 64))
    expect("rope_pool_fused expects CUDA or MPS tensors", compiled(f), *args)


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(5, 4, 8)
        assert attnprep.pack_qkv_destination_major(q, q, q, 2).shape == (2, 5, 2, 24)
        assert attnprep.usp_merge_heads(torch.empty(2, 3, 1, 4, 8)).shape == (1, 3, 2, 4, 8)
        out = attnprep.rope_pool_fused(torch.empty(4, 8, 64), torch.empty(4, 2, 64), torch.empty(4, 2, 64),
                                       torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long),
                                       torch.empty(16, 2, 64), torch.empty(16, 2, 64), head_dim=64, num_qo_heads=8,
                                       num_kv_heads=2, rope_base=1e4)
        assert out[0].shape == (4, 8, 64) and out[1].shape == (4, 2, 64)
