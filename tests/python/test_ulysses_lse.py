"""The Ulysses layer with return_lse: an attn_fn returning (out, lse), the
layer returning the rank's output and the lse of its rows for every head (what
ring attention combines), with gloo on CPU processes. Each rank's out and lse
must equal float64 attention over the whole sequence on one process, sliced to
its rows, for 3-D inputs and for batched ones with uneven rows, a head count
the world size does not divide and a key mask; the options it cannot serve
raise the same error on every rank."""

import math

import pytest
import torch
from attnprep import ulysses
from conftest import assert_ranks_ok, error_text, gloo_case_reports, run_rank


def attention_lse(q, k, v, key_mask=None):
    """[B, S, h, D] (k, v with h or fewer heads) -> (out [B, S, h, D], lse [B, h, S]): softmax attention and the
    log-sum-exp of each query's scores, keys masked out where key_mask [B, S] is False."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(q.shape[-1])
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhst,bthd->bshd", torch.softmax(scores, dim=-1), v)
    return out, lse.float()


def attn_3d(q, k, v):
    """The layer's 3-D attn_fn: [S, h, D] -> (out [S, h, D], lse [h, S])."""
    out, lse = attention_lse(q[None], k[None], v[None])
    return out[0], lse[0]


def _lse_body(rank, world, device):
    failures = []
    g = torch.Generator().manual_seed(7)
    # 3-D: 6 rows a rank, 4 q heads over 2 kv heads per rank
    rows, heads, kv = 6, 4 * world, 2 * world
    q, k, v = (torch.randn(world * rows, n, 16, generator=g, dtype=torch.float64) for n in (heads, kv, kv))
    want_out, want_lse = attention_lse(q[None], k[None], v[None])
    mine = slice(rank * rows, (rank + 1) * rows)
    out, lse = ulysses.ulysses_attention(q[mine], k[mine], v[mine], attn_fn=attn_3d, return_lse=True)
    if not (torch.allclose(out, want_out[0, mine], atol=1e-12) and lse.shape == (heads, rows)):
        failures.append(f"3-D out or lse shape {tuple(lse.shape)}")
    elif not torch.allclose(lse, want_lse[0][:, mine], atol=1e-5):
        failures.append("3-D lse")
    # batched: rows 5, 4, ... (uneven), 3 heads (padded to the world size), kv expanded, a key mask
    rows_of = [5 - r % 2 for r in range(world)]
    total, heads = sum(rows_of), 3
    q, k, v = (torch.randn(2, total, n, 16, generator=g, dtype=torch.float64) for n in (heads, 1, 1))
    mask = torch.rand(2, total, generator=g) > 0.3
    mask[:, 0] = True
    want_out, want_lse = attention_lse(q, k, v, mask)
    start = sum(rows_of[:rank])
    mine = slice(start, start + rows_of[rank])
    layer = ulysses.UlyssesAttention(attn_fn=attention_lse, return_lse=True)
    out, lse = layer(q[:, mine], k[:, mine], v[:, mine], key_padding_mask=mask[:, mine])
    if not (torch.allclose(out, want_out[:, mine], atol=1e-12) and lse.shape == (2, heads, rows_of[rank])):
        failures.append(f"batched out or lse shape {tuple(lse.shape)}")
    elif not torch.allclose(lse, want_lse[:, :, mine], atol=1e-5):
        failures.append("batched lse")
    return "; ".join(failures) or "ok"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_out_and_lse_of_every_rank(world):
    assert_ranks_ok(run_rank, world, "gloo", _lse_body)


def _refused_body(rank, world, device, what):
    q = torch.randn(4, 4, 16, dtype=torch.float64)
    k = v = torch.randn(4, 2, 16, dtype=torch.float64)
    kw = dict(attn_fn=attn_3d, return_lse=True)
    if what == "no attn_fn":
        kw.pop("attn_fn")
    if what == "chunks":  # two chunks of 2 q heads and 1 kv head a rank
        q, k = torch.randn(4, 8, 16, dtype=torch.float64), torch.randn(4, 4, 16, dtype=torch.float64)
        v = k
        kw["chunks"] = 2
    if what == "type":
        kw["return_lse"] = 1
    if what == "disagree" and rank == 1:
        kw = dict(attn_fn=attn_3d)
    if what == "bad attn_fn":
        kw["attn_fn"] = lambda q, k, v: attn_3d(q, k, v)[0]
    return error_text(lambda: ulysses.ulysses_attention(q, k, v, **kw))


ERRORS = [
    ("no attn_fn", "ValueError: ulysses: rank 0: " + ulysses.LSE_NEEDS_ATTN_FN),
    ("chunks", "ValueError: ulysses: rank 0: " + ulysses.LSE_NEEDS_ONE_CHUNK),
    ("type", "TypeError: ulysses: rank 0: ulysses: return_lse must be a bool, got int"),
    ("disagree", "ValueError: ulysses: every rank must pass the same return_lse, got [True, False]"),
    (
        "bad attn_fn",
        "ValueError: ulysses: with return_lse=True, attn_fn must return (out, lse): out shaped like its q, "
        "torch.Size([8, 2, 16]), and lse float32 [2, 8], on cpu, got a tensor torch.Size([8, 2, 16])",
    ),
]


@pytest.mark.parametrize("what, message", ERRORS)
def test_what_it_cannot_serve_raises_on_every_rank(what, message):
    got, codes = gloo_case_reports(_refused_body, 2, [c for c, _ in ERRORS], what)
    assert got == [(0, message), (1, message)], got
    assert codes == [0, 0]
