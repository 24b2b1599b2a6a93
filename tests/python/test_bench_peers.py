"""The benchmarks' peers (bench/peers.py) do the work attnprep does: every
plain-PyTorch formulation, eager on the CPU, gives attnprep.testing's
reference values in a contiguous tensor of the reference's shape, and
peers.check refuses the right values in another layout (a formulation that
returned a strided view would be timed without the reordering it skips)."""

import pathlib
import sys

import pytest
import torch
from attnprep.testing import merge_reference, mrope_cos_sin_rows, pack_reference, rope_reference

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import bench_rope_pool  # noqa: E402
import peers  # noqa: E402


def pack_inputs(rows, heads, dim, fused):
    g = torch.Generator().manual_seed(rows * heads + dim)
    if fused:  # slices of one projection, as servers pass them
        qkv = torch.randn(rows, 3 * heads * dim, generator=g, dtype=torch.float32).to(torch.bfloat16)
        return tuple(t.view(rows, heads, dim) for t in qkv.split(heads * dim, dim=1))
    return tuple(torch.randn(rows, heads, dim, generator=g).to(torch.bfloat16) for _ in range(3))


@pytest.mark.parametrize("name", list(peers.PACK_FORMULATIONS))
@pytest.mark.parametrize(
    "rows, heads, dim, world, fused",
    [(17, 8, 16, 2, False), (5, 12, 8, 4, True), (1, 6, 4, 3, False), (65, 8, 128, 8, True)],
)
def test_pack_formulations(name, rows, heads, dim, world, fused):
    q, k, v = pack_inputs(rows, heads, dim, fused)
    peers.check(peers.PACK_FORMULATIONS[name](q, k, v, world), pack_reference(q, k, v, world), name)


@pytest.mark.parametrize("name", list(peers.MERGE_FORMULATIONS))
@pytest.mark.parametrize("shape", [(2, 17, 1, 3, 16), (4, 5, 2, 1, 8), (1, 1, 1, 1, 4)])
def test_merge_formulations(name, shape):
    x = torch.randn(shape).to(torch.bfloat16)
    peers.check(peers.MERGE_FORMULATIONS[name](x), merge_reference(x), name)


def test_check_refuses_a_view_in_another_layout():
    q, k, v = pack_inputs(9, 8, 16, False)
    rows, heads, dim, w = 9, 8, 16, 2
    parts = [t.reshape(rows, w, heads // w, 1, dim) for t in (q, k, v)]
    view = torch.cat(parts, 3).permute(1, 0, 2, 3, 4).reshape(w, rows, heads // w, 3 * dim)  # no copy: a view
    want = pack_reference(q, k, v, w)
    assert torch.equal(view, want) and not view.is_contiguous()
    with pytest.raises(AssertionError) as e:
        peers.check(view, want, "view")
    assert str(e.value) == "view: not a contiguous (2, 9, 4, 48) tensor"
    wrong = want.clone()
    wrong[0, 0, 0, 0] += 1
    with pytest.raises(AssertionError) as e:
        peers.check(wrong, want, "wrong")
    assert str(e.value) == "wrong: wrong values"


@pytest.mark.parametrize("section, interleaved", [([16, 24, 24], False), ([24, 20, 20], True)])
def test_the_compiled_mrope_peer_is_the_models_mrope(section, interleaved):
    """bench_rope_pool's M-RoPE formulation (float32, on the CPU) against the
    reference: rows gathered by axis (attnprep.testing, checked against
    transformers) from the table of the same angles, rotated in float64."""
    g = torch.Generator().manual_seed(5)
    T, D = 13, bench_rope_pool.D
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (4, 2, 2))
    positions = torch.randint(0, 50, (3, T), generator=g)
    freqs = (1.0 / bench_rope_pool.BASE ** (torch.arange(D // 2, dtype=torch.float64) * 2 / D)).float()
    angle = torch.arange(50, dtype=torch.float32)[:, None] * freqs
    table = torch.cat([angle.cos(), angle.sin()], dim=1)
    k_pool, v_pool = torch.zeros(T, 2, D), torch.zeros(T, 2, D)
    slots = torch.randperm(T, generator=g)
    got = bench_rope_pool.torch_mrope_pool(q, k, v, positions, slots, k_pool, v_pool, freqs, section, interleaved)
    rows = mrope_cos_sin_rows(table, positions, section, interleaved).double()
    for x, out in zip((q, k), got):
        want = rope_reference(x, rows[:, : D // 2], rows[:, D // 2 :], D, True)
        assert torch.allclose(out.double(), want, rtol=0, atol=1e-5)
    assert torch.equal(k_pool[slots], got[1]) and torch.equal(v_pool[slots], v)
