"""fp8 on the Ulysses wire: the format's round trip, and the layer's output
against float64 attention over the whole sequence (gloo ranks here; NCCL
where GPUs are), every rank agreeing on the wire dtype."""

import pytest
import torch

from attnprep import ulysses
from attnprep.testing import attention_reference
from conftest import assert_ranks_ok, nccl_ranks_ok, run_rank

WIRES = {torch.float8_e4m3fn: 2**-4, torch.float8_e5m2: 2**-3}  # half an ulp at the top of the format, relative


@pytest.mark.parametrize("wire", list(WIRES), ids=str)
def test_wire_round_trip(wire):
    x = torch.randn(3, 5, 4, 64, dtype=torch.bfloat16) * torch.logspace(-3, 3, 4)[None, None, :, None]
    x[0, 0, 0] = 0  # an all-zero block
    buf = ulysses._to_wire(x, wire)
    assert buf.dtype == torch.uint8 and buf.shape == (3, 5, 4 * 64 + 4 * 4)  # fp8 values, then float32 scales
    y = ulysses._from_wire(buf, x.shape, wire, x.dtype)
    block_max = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-30)
    assert ((y.float() - x.float()).abs() / block_max).max().item() <= WIRES[wire] + 2**-8  # + bf16 output rounding
    assert torch.equal(y[0, 0, 0], x[0, 0, 0])


def test_wire_errors():
    with pytest.raises(ValueError) as e:
        ulysses._wire_code(torch.bfloat16)
    assert str(e.value) == "ulysses: wire_dtype must be None, torch.float8_e4m3fn or torch.float8_e5m2"
    with pytest.raises(ValueError) as e:
        ulysses._wire_code(torch.float8_e4m3fn, 2)
    assert str(e.value) == "ulysses: wire_dtype needs chunks=1"


# the layer's output error against float64 attention, relative to max |v|:
# measured over these shapes (head_dim 32, random normal inputs, world 1-3)
# at most 0.066 (e4m3) and 0.108 (e5m2); the bounds leave half as much again
LAYER_BOUND = {torch.float8_e4m3fn: 0.1, torch.float8_e5m2: 0.16}


def _layer(rank, world, device):
    rows, dim, worst = 6, 32, {}
    for heads, kv in [(4 * world, 4 * world), (4 * world, world), (2 * world, 1)]:
        for causal in (False, True):
            g = torch.Generator().manual_seed(heads + kv)
            q, k, v = (torch.randn(world * rows, n, dim, generator=g, dtype=torch.float64) for n in (heads, kv, kv))
            mine = slice(rank * rows, (rank + 1) * rows)
            want = attention_reference(q, k, v, causal)[mine]
            for wire, bound in LAYER_BOUND.items():
                got = ulysses.ulysses_attention(*(t[mine].to(device) for t in (q, k, v)), causal=causal,
                                                wire_dtype=wire).cpu()
                err = ((got - want).abs().max() / v.abs().max()).item()
                worst[wire] = max(worst.get(wire, 0.0), err)
                if not err <= bound:
                    return f"({heads}, {kv}, causal {causal}) {wire}: error {err:.3g} > {bound}"
    # ranks that disagree on the wire dtype all raise
    q, k, v = (torch.randn(rows, n, dim, dtype=torch.float64, device=device) for n in (4 * world, world, world))
    wire = torch.float8_e4m3fn if rank == 0 else None
    try:
        ulysses.ulysses_attention(q, k, v, wire_dtype=wire)
        if world > 1:
            return "no error for disagreeing wire dtypes"
    except ValueError as e:
        want = "ulysses: every rank must pass the same wire_dtype, got [torch.float8_e4m3fn, " + \
            ", ".join("None" for _ in range(world - 1)) + "]"
        if str(e) != want:
            return str(e)
    print(f"rank {rank}: fp8 wire, worst output error / max |v|: " +
          ", ".join(f"{w}: {e:.3g}" for w, e in worst.items()))
    return "ok"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_gloo_layer_with_fp8_on_the_wire(world):
    assert_ranks_ok(run_rank, world, "gloo", _layer)


@pytest.mark.parametrize("world", [2])
def test_nccl_layer_with_fp8_on_the_wire(world):
    nccl_ranks_ok(world, _layer)
