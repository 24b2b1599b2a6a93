"""The Ulysses exchange in chunks of heads, overlapped with attention: the
same result as the unchunked layer and as attention over the whole sequence
(gloo ranks on CPU here; NCCL where GPUs are), chunk counts checked and
agreed on by every rank."""

import pytest
import torch
from attnprep import ulysses
from attnprep.testing import attention_reference, pack_gqa_reference
from conftest import assert_ranks_ok, nccl_ranks_ok, run_rank

# (heads, kv_heads, chunks) per world size: MHA, kv split, kv replicated
CASES = {
    1: [(4, 4, 2), (8, 4, 4), (4, 1, 1)],
    2: [(8, 8, 2), (8, 4, 2), (8, 1, 4)],
    3: [(6, 6, 2), (12, 6, 2), (12, 1, 4)],
    4: [(16, 16, 4), (16, 8, 2), (16, 2, 2)],
}


@pytest.mark.parametrize("heads, kv, world, chunks", [(8, 4, 2, 2), (12, 2, 4, 3), (8, 8, 2, 4), (8, 1, 2, 2)])
def test_cpu_chunked_pack_matches_reference(heads, kv, world, chunks):
    q, k, v = torch.randn(5, heads, 16), torch.randn(5, kv, 16), torch.randn(5, kv, 16)
    got = ulysses.exchange._pack_torch(q, k, v, world, chunks)
    local_q = heads // world
    for c in range(chunks):  # chunk c is the unchunked pack of those heads
        sel = [d * local_q + c * (local_q // chunks) + h for d in range(world) for h in range(local_q // chunks)]
        if kv >= world:
            local_kv = kv // world
            ksel = [
                d * local_kv + c * (local_kv // chunks) + h for d in range(world) for h in range(local_kv // chunks)
            ]
        else:
            ksel = list(range(kv))
        want = pack_gqa_reference(q[:, sel], k[:, ksel], v[:, ksel], world)
        assert torch.equal(got[c], want)


def _worker(rank, world, device):
    rows, dim = 5, 16
    for heads, kv, chunks in CASES[world]:
        for causal in (False, True):
            g = torch.Generator().manual_seed(heads * 10 + kv)
            q, k, v = (torch.randn(world * rows, n, dim, generator=g, dtype=torch.float64) for n in (heads, kv, kv))
            mine = slice(rank * rows, (rank + 1) * rows)
            local = [t[mine].to(device) for t in (q, k, v)]
            for c in (chunks, "auto"):
                got = ulysses.ulysses_attention(*local, causal=causal, chunks=c)
                want = attention_reference(q, k, v, causal)[mine]
                err = (got.cpu() - want).abs().max().item()
                if got.shape != want.shape or err > 1e-12:
                    return f"({heads}, {kv}, chunks {c}, causal {causal}): error {err}"
    # every rank refuses a chunk count that does not divide its heads, or one the others do not share
    q, k, v = (torch.randn(rows, n, dim, dtype=torch.float64, device=device) for n in (4 * world, 2 * world, 2 * world))
    refused = (
        "ulysses: rank 0: ulysses: chunks must be positive and divide each rank's q heads "
        "(and its kv heads when they are split)"
    )
    for chunks, msg in [
        (3, refused),
        (2**70, refused),
        (-(2**70), refused),  # past int64: the same check
        (2 if rank == 0 else 1, None),
    ]:
        try:
            ulysses.ulysses_attention(q, k, v, chunks=chunks)
            if world > 1 or msg:
                return f"no error for chunks {chunks}"
        except ValueError as e:
            want = msg or (
                "ulysses: every rank must pass the same chunks, got [2, "
                + ", ".join("1" for _ in range(world - 1))
                + "]"
            )
            if str(e) != want:
                return str(e)
    return "ok"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gloo_chunked_layer_equals_attention_reference(world):
    assert_ranks_ok(run_rank, world, "gloo", _worker)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_nccl_chunked_layer_equals_attention_reference(world):
    """One process per GPU: the CUDA chunked pack and NCCL's asynchronous
    all_to_alls, overlapped with attention."""
    if world not in CASES:
        pytest.skip(f"no cases for {world} ranks")
    nccl_ranks_ok(world, _worker)


def _attn_result_checked(rank, world, device, transport="nccl"):
    """An attn_fn that returns the wrong shape, a flat tensor or no tensor:
    every rank raises the documented error before anything reads the result,
    chunked or not; one that raises on a later chunk: its error on every
    rank; and the layer works afterwards."""
    rows, heads, dim = 5, 4 * world, 16
    dtype = torch.float64 if device.type == "cpu" else torch.bfloat16
    q, k, v = (torch.randn(rows, heads, dim, dtype=dtype, device=device) for _ in range(3))
    for chunks in (1, 2):
        shape = torch.Size([world * rows, heads // world // chunks, dim])
        bad = [
            (lambda q_, k_, v_: q_[:, :1], f"{torch.Size([shape[0], 1, dim])} on {device}"),
            (lambda q_, k_, v_: q_.reshape(-1), f"{torch.Size([shape.numel()])} on {device}"),
            (lambda q_, k_, v_: None, "NoneType"),
        ]
        for fn, got in bad:
            try:
                ulysses.ulysses_attention(q, k, v, attn_fn=fn, chunks=chunks, transport=transport)
                return f"chunks {chunks}: no error"
            except ValueError as e:
                want = f"ulysses: attn_fn must return a tensor shaped like its q, {shape} on {device}, got {got}"
                if str(e) != want:
                    return f"chunks {chunks}: {e!s} != {want}"
        if chunks > 1:  # an attn_fn that fails on a later chunk, after the first chunk's output went back
            calls = []

            def second_fails(q_, k_, v_):
                calls.append(1)
                if len(calls) == 2:
                    raise RuntimeError("attention failed")
                return ulysses.sdpa(False)(q_, k_, v_)

            try:
                ulysses.ulysses_attention(q, k, v, attn_fn=second_fails, chunks=chunks, transport=transport)
                return f"chunks {chunks}: no error from the second chunk"
            except RuntimeError as e:
                if str(e) != "attention failed":
                    return f"chunks {chunks}: {e}"
        for _ in range(2):  # the layer works afterwards, twice (the flags as a call leaves them)
            out = ulysses.ulysses_attention(q, k, v, chunks=chunks, transport=transport)
            if not torch.equal(out, ulysses.ulysses_attention(q, k, v, chunks=chunks)):
                return f"chunks {chunks}: differs after the errors"
    return "ok"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gloo_attn_result_checked(world):
    assert_ranks_ok(run_rank, world, "gloo", _attn_result_checked)


@pytest.mark.parametrize("transport", ["nccl", "copy_engine"])
def test_nccl_attn_result_checked(transport):
    nccl_ranks_ok(2, _attn_result_checked, transport)
