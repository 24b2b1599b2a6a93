"""The Ulysses layer on the models' shapes, with gloo on CPU processes:
[B, S_local, H, D] inputs (strided views), a different number of rows on
each rank, head counts the world size does not divide, a key-padding mask.
Each rank's output must equal single-process attention over the whole
sequence (the ranks' rows in rank order, padded keys and masked keys left
out), sliced to its rows; a disagreement raises the same error on every rank."""

import pytest
import torch
import torch.nn.functional as F
from attnprep import ulysses
from conftest import assert_ranks_ok, error_text, gloo_case_reports, nccl_ranks_ok, run_rank, spawn_ranks


def reference(q, k, v, key_mask, causal):
    """float64 attention over whole sequences [B, S, H, D]; key_mask [B, S] (True: attend)."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    mask = key_mask[:, None, None, :]
    if causal:
        s = q.shape[1]
        mask = mask & torch.ones(s, s, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


def shards(world, rows_of, batch, heads, kv, dim, masked, seed):
    """The whole sequence's q, k, v (float64) and key mask, and each rank's slice."""
    g = torch.Generator().manual_seed(seed)
    total = sum(rows_of)
    q, k, v = (torch.randn(batch, total, n, dim, generator=g, dtype=torch.float64) for n in (heads, kv, kv))
    mask = torch.ones(batch, total, dtype=torch.bool)
    if masked:
        mask = torch.rand(batch, total, generator=g) > 0.3
        mask[:, 0] = True  # every query has a key to attend to
    starts = [sum(rows_of[:r]) for r in range(world)]
    return q, k, v, mask, [slice(s, s + n) for s, n in zip(starts, rows_of)]


def _layer_body(rank, world, device, cases):
    failures = []  # every case runs on every rank (a rank that stopped early would leave the others waiting)
    for rows_of, batch, heads, kv, masked, causal, chunks in cases:
        q, k, v, mask, mine = shards(world, rows_of, batch, heads, kv, 16, masked, seed=len(rows_of) + heads + batch)
        want = reference(q, k, v, mask, causal)[:, mine[rank]]
        # strided views: q and k as slices of one fused projection's output
        fused = torch.cat([q, k, v], dim=2)[:, mine[rank]]
        ql, kl, vl = fused.split([heads, kv, kv], dim=2)
        layer = ulysses.UlyssesAttention(causal=causal, chunks=chunks)
        got = layer(ql, kl, vl, key_padding_mask=mask[:, mine[rank]] if masked else None)
        err = (got - want).abs().max().item() if got.shape == want.shape else None
        case = f"{rows_of} B={batch} H={heads}/{kv} masked={masked} causal={causal} chunks={chunks}"
        if err is None or err > 1e-12:
            failures.append(f"{case}: shape {tuple(got.shape)} err {err}")
        # a control that skips the exchange (the last rank attending to its own rows only, where it
        # sees every rank's keys) must fail the same comparison
        if world > 1 and rank == world - 1:
            alone = reference(q[:, mine[rank]], k[:, mine[rank]], v[:, mine[rank]], mask[:, mine[rank]], causal)
            if (alone - want).abs().max().item() < 1e-6:
                failures.append(f"{case}: the control passed")
    return "; ".join(failures) or "ok"


CASES = {
    2: [
        ([4, 4], 2, 4, 2, False, False, 1),  # even rows and heads, GQA
        ([14, 13], 2, 4, 4, False, True, 1),  # 27 tokens on 2 ranks, causal
        ([17, 16], 1, 3, 1, True, False, 1),  # 3 heads on 2 ranks (padded), kv expanded, a mask
        ([5, 9], 2, 6, 6, True, True, 3),  # uneven rows, a mask, causal, chunks
    ],
    3: [([5, 6, 7], 2, 4, 2, True, True, 1), ([3, 3, 3], 1, 12, 6, False, False, 2)],
    4: [([17, 16, 16, 16], 2, 6, 6, True, False, 1), ([4, 1, 2, 3], 1, 5, 1, False, True, 1)],
}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_layer_on_batched_uneven_inputs(world):
    cases = CASES.get(world, [([6], 2, 3, 1, True, True, 1)])
    assert_ranks_ok(run_rank, world, "gloo", _layer_body, cases)


def _disagreement_body(rank, world, device, what):
    q = torch.randn(2, 5, 4, 16, dtype=torch.float64)
    k = v = torch.randn(2, 5, 2, 16, dtype=torch.float64)
    mask = None
    if what == "batch" and rank == 1:
        q, k, v = q[:1], k[:1], v[:1]
    if what == "mask" and rank == 0:
        mask = torch.ones(2, 5, dtype=torch.bool)
    if what == "dtype" and rank == 1:
        q, k, v = q.float(), k.float(), v.float()
    if what == "dims" and rank == 1:
        q, k, v = q[0], k[0], v[0]
    if what == "mask shape" and rank == 1:
        mask = torch.ones(2, 4, dtype=torch.bool)
    return error_text(lambda: ulysses.ulysses_attention(q, k, v, key_padding_mask=mask))


ERRORS = [
    ("batch", "ValueError: ulysses: every rank must pass the same batch, got [2, 1]"),
    ("mask", "ValueError: ulysses: every rank must pass the same key_padding_mask, got [True, False]"),
    ("dtype", "ValueError: ulysses: every rank must pass the same dtype, got [torch.float64, torch.float32]"),
    ("dims", "ValueError: ulysses: every rank must pass the same q dims, got [4, 3]"),
    (
        "mask shape",
        "ValueError: ulysses: rank 1: ulysses: key_padding_mask must be a bool tensor [batch, rows] on q's device",
    ),
]


@pytest.mark.parametrize("what, message", ERRORS)
def test_every_rank_raises_the_same_error(what, message):
    got, codes = gloo_case_reports(_disagreement_body, 2, [c for c, _ in ERRORS], what)
    assert got == [(0, message), (1, message)], got
    assert codes == [0, 0]


def _local_errors_body(rank, world, device):
    q = torch.randn(2, 5, 4, 16)
    out = []
    for args, kw in [
        ((q, torch.randn(2, 5, 3, 16), torch.randn(2, 5, 3, 16)), {}),
        ((q, torch.randn(2, 4, 2, 16), torch.randn(2, 4, 2, 16)), {}),
        ((q[0], q[0], q[0]), dict(key_padding_mask=torch.ones(5, dtype=torch.bool))),
        ((q, q, q), dict(key_padding_mask=torch.ones(2, 5))),
        ((q, q, q), dict(key_padding_mask=[True] * 5)),
    ]:
        try:
            ulysses.ulysses_attention(*args, **kw)
            out.append("no error")
        except (ValueError, TypeError) as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def test_local_checks_in_order():
    (got,), codes = spawn_ranks(run_rank, 1, "gloo", _local_errors_body, timeout=120)
    assert got[1] == [
        "ValueError: ulysses: rank 0: ulysses: kv_heads must divide the q heads",
        "ValueError: ulysses: rank 0: ulysses: q must be [batch, rows, heads, head_dim] and k, v "
        "[batch, rows, kv_heads, head_dim]",
        "ValueError: ulysses: rank 0: ulysses: key_padding_mask needs batched [batch, rows, heads, head_dim] inputs",
        "ValueError: ulysses: rank 0: ulysses: key_padding_mask must be a bool tensor [batch, rows] on q's device",
        "TypeError: ulysses: rank 0: key_padding_mask must be a torch.Tensor, got list",
    ]
    assert codes == [0]


def _views_body(rank, world, device, dtype):
    """Attention's q, k and v for B = 2 are views of one receive buffer (no copy on the receiver), [B, S, h, D] with
    a unit last stride, and the layer still equals float64 attention over the whole sequence."""
    rows_of = [5, 4][:world] if world > 1 else [7]
    q, k, v, mask, mine = shards(world, rows_of, 2, 4, 2, 32, True, seed=7)
    want = reference(q, k, v, mask, False)[:, mine[rank]]
    seen = []
    inner = ulysses.sdpa_batched()

    def attn(ql, kl, vl, key_mask):
        bases = {t.untyped_storage().data_ptr() for t in (ql, kl, vl)}
        seen.append((len(bases), ql.shape[0], ql.stride(-1), kl.stride(-1), vl.stride(-1)))
        return inner(ql, kl, vl, key_mask)

    def local(t):
        return t[:, mine[rank]].to(device=device, dtype=dtype)

    got = ulysses.ulysses_attention(
        local(q), local(k), local(v), attn_fn=attn, key_padding_mask=mask[:, mine[rank]].to(device)
    )
    err = ((got.double().cpu() - want).abs().max() / want.abs().max()).item()
    tol = 1e-12 if dtype == torch.float64 else 1e-5 if dtype == torch.float32 else 1e-2
    if seen != [(1, 2, 1, 1, 1)]:
        return f"attention saw {seen}: not views of one receive buffer"
    return "ok" if err <= tol else f"error {err} over {tol}"


@pytest.mark.parametrize("world", [1, 2])
def test_attention_reads_views_of_the_receive_buffer(world):
    assert_ranks_ok(run_rank, world, "gloo", _views_body, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_reads_views_of_the_receive_buffer_nccl(dtype):
    nccl_ranks_ok(1, _views_body, dtype)
