"""The pack-free Ulysses input side: projection weights rearranged once, one
batched GEMM that writes the send buffer. Against projecting q, k, v and
packing them with attnprep.testing's references: bit for bit on
integer-valued inputs (every summation order is exact there), and through
gloo ranks against scatter_heads of the projected q, k, v."""

import pytest
import torch
from attnprep import ulysses
from attnprep.testing import pack_gqa_reference, pack_reference
from conftest import assert_ranks_ok, run_rank

GEOMETRIES = [(8, 8, 2), (8, 8, 4), (8, 4, 2), (12, 2, 4), (12, 1, 3), (8, 2, 8), (4, 4, 1), (6, 3, 3)]


def integers(*shape, generator):
    return torch.randint(-4, 5, shape, generator=generator).double()


def layer(heads, kv, D=16, hidden=24, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = [integers(n * D, hidden, generator=g) for n in (heads, kv, kv)]
    b = [integers(n * D, generator=g) for n in (heads, kv, kv)] if bias else [None] * 3
    return w, b


def projected(x, w, b, D):
    out = [x @ wi.T + (bi if bi is not None else 0) for wi, bi in zip(w, b)]
    return [t.view(x.shape[0], -1, D) for t in out]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("heads, kv, world", GEOMETRIES)
def test_send_buffer_equals_projection_then_pack(heads, kv, world, bias):
    D, rows = 16, 7
    w, b = layer(heads, kv, D, bias=bias, seed=heads * 10 + kv)
    weight, b_all = ulysses.destination_major_qkv_weight(*w, world, D, *b)
    assert weight.shape == (world, (heads + 2 * kv) * D // world if kv >= world else (heads // world + 2) * D, 24)
    x = integers(rows, 24, generator=torch.Generator().manual_seed(1))
    send = ulysses.project_destination_major(x, weight, b_all)
    q, k, v = projected(x, w, b, D)
    want = pack_reference(q, k, v, world).view(world, rows, -1) if kv == heads else pack_gqa_reference(q, k, v, world)
    assert torch.equal(send, want)


def test_float32_within_rounding():
    D, rows = 64, 33
    g = torch.Generator().manual_seed(3)
    w = [torch.randn(n * D, 256, generator=g) for n in (8, 2, 2)]
    b = [torch.randn(n * D, generator=g) for n in (8, 2, 2)]
    x = torch.randn(rows, 256, generator=g)
    weight, bias = ulysses.destination_major_qkv_weight(*w, 2, D, *b)
    send = ulysses.project_destination_major(x, weight, bias)
    want = pack_gqa_reference(*projected(x, w, b, D), 2)
    assert (send - want).abs().max().item() < 1e-4 * want.abs().max().item()


@pytest.mark.parametrize(
    "args, msg",
    [
        (
            lambda w: (w[0][:, :5], w[1], w[2], 2, 16),
            "ulysses: w_q, w_k and w_v must be 2-D [heads * head_dim, hidden] with one hidden size and dtype",
        ),
        (
            lambda w: (w[0], w[1].float(), w[2], 2, 16),
            "ulysses: w_q, w_k and w_v must be 2-D [heads * head_dim, hidden] with one hidden size and dtype",
        ),
        (
            lambda w: (w[0], w[1], w[2], 2, 24),
            "ulysses: head_dim must be positive and divide the rows of w_q, w_k and w_v",
        ),
        (
            lambda w: (w[0], w[1], w[2], 2, 0),
            "ulysses: head_dim must be positive and divide the rows of w_q, w_k and w_v",
        ),
        (lambda w: (w[0], w[1], w[2], 3, 16), "ulysses: world_size must divide the number of q heads"),
        (lambda w: (w[0], w[1], w[2], 2**70, 16), "ulysses: world_size must divide the number of q heads"),
        (
            lambda w: (w[0], w[1][:48], w[2][:48], 2, 16),
            "ulysses: kv_heads must divide the q heads, and divide or be a multiple of world_size",
        ),
        (
            lambda w: (w[0], w[1], w[2], 2, 16, torch.zeros(128)),
            "ulysses: b_q, b_k and b_v must be given together, each [heads * head_dim] of its weight",
        ),
    ],
)
def test_weight_errors(args, msg):
    w, _ = layer(8, 4)
    with pytest.raises(ValueError) as e:
        ulysses.destination_major_qkv_weight(*args(w))
    assert str(e.value) == msg


@pytest.mark.parametrize("world_size", ["2", 2.0, True, None])
def test_world_size_of_another_type(world_size):
    w, _ = layer(8, 4)
    with pytest.raises(TypeError) as e:
        ulysses.destination_major_qkv_weight(*w, world_size, 16)
    assert str(e.value) == f"ulysses: world_size must be an int, got {type(world_size).__name__}"


def test_x_errors():
    w, b = layer(8, 4)
    weight, bias = ulysses.destination_major_qkv_weight(*w, 2, 16, *b)
    for x in (torch.zeros(3, 25, dtype=torch.float64), torch.zeros(3, 24), torch.zeros(2, 3, 24, dtype=torch.float64)):
        with pytest.raises(ValueError) as e:
            ulysses.project_destination_major(x, weight, bias)
        assert str(e.value) == "ulysses: x must be [rows, hidden] with the weight's hidden size and dtype"


def _worker(rank, world, device):
    D, rows = 16, 5
    for heads, kv in [(4 * world, 4 * world), (4 * world, world), (2 * world, 1)]:
        w, b = layer(heads, kv, D, seed=heads + kv)  # the same weights on every rank
        x = integers(rows, 24, generator=torch.Generator().manual_seed(100 + rank))
        proj = ulysses.UlyssesQKVProjection.from_weights(*w, world, D, *b)
        got = proj(x)
        want = ulysses.scatter_heads(*projected(x, w, b, D))
        if not all(torch.equal(g, h) for g, h in zip(got, want)):
            return f"({heads}, {kv}) differs"
        work = proj(x, async_op=True)
        if not all(torch.equal(g, h) for g, h in zip(work.wait(), want)):
            return f"({heads}, {kv}) async differs"
    # the ranks agree first: one rank with another row count fails everywhere
    if world == 1:
        return "ok"
    try:
        proj(integers(rows + rank, 24, generator=torch.Generator()))
        return "no error for uneven rows"
    except ValueError as e:
        if not str(e).startswith("ulysses: every rank must hold the same number of rows, got ["):
            return str(e)
    return "ok"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_gloo_projection_equals_scatter_of_the_projection(world):
    assert_ranks_ok(run_rank, world, "gloo", _worker)
