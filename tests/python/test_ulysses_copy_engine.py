"""The Ulysses layer's copy-engine transport (transport="copy_engine"): bit
for bit the NCCL transport's result, chunked or not, MHA and GQA (split and
replicated kv heads), contiguous and strided inputs, odd rows, on repeated
calls (the receive buffers and flags reused); its checks on every rank alike. The transport needs
GPUs: on CPU only the checks run (gloo ranks)."""

import pytest
import torch
from attnprep import _peer, ulysses
from conftest import assert_ranks_ok, nccl_ranks_ok, run_rank

BAD_TRANSPORT = 'ulysses: transport must be "nccl" or "copy_engine"'
NEEDS = 'ulysses: transport="copy_engine" needs CUDA tensors and wire_dtype=None'


def _checks(rank, world, device):
    rows, dim = 3, 8
    q, k, v = (torch.randn(rows, n, dim, device=device) for n in (2 * world, world, world))
    cases = [(dict(transport="rdma"), BAD_TRANSPORT), (dict(transport=None), BAD_TRANSPORT)]
    if device.type == "cpu":
        cases.append((dict(transport="copy_engine"), NEEDS))
    else:
        cases.append((dict(transport="copy_engine", wire_dtype=torch.float8_e4m3fn), NEEDS))
    for kw, msg in cases:
        for validate in (True, False):
            try:
                ulysses.ulysses_attention(q, k, v, validate=validate, **kw)
                return f"no error for {kw}"
            except ValueError as e:
                want = f"ulysses: rank 0: {msg}" if validate else msg
                if str(e) != want:
                    return f"{kw}, validate={validate}: {e}"
    return "ok"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gloo_transport_checks(world):
    assert_ranks_ok(run_rank, world, "gloo", _checks)


def _same_as_nccl(rank, world, device):
    dim = 64
    for rows, heads, kv in [(40, 8, 8), (17, 8, 4), (40, 8, 1), (1, 4, 1)]:
        for chunks in (1, 2):
            for call in range(3):  # later calls reuse the receive buffers and flags
                g = torch.Generator().manual_seed(1000 * call + 10 * heads + kv + rank)
                # call 1: q, k, v are slices of one fused projection (rows strided, heads adjacent);
                # call 2: heads not adjacent (a transposed view)
                fused = torch.randn(rows, (heads + 2 * kv) * dim, generator=g).to(torch.bfloat16).to(device)
                q, k, v = (t.view(rows, -1, dim) for t in fused.split([heads * dim, kv * dim, kv * dim], -1))
                if call == 0:
                    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
                if call == 2:
                    q = q.transpose(0, 1).contiguous().transpose(0, 1)
                got = ulysses.ulysses_attention(q, k, v, causal=True, chunks=chunks, transport="copy_engine")
                want = ulysses.ulysses_attention(q, k, v, causal=True, chunks=chunks)
                torch.cuda.synchronize()
                if not torch.equal(got, want):
                    err = (got.float() - want.float()).abs().max().item()
                    return f"({rows}, {heads}, {kv}, chunks {chunks}, call {call}): differs from NCCL by {err}"
    # ranks that disagree on the transport all raise the same error
    q, k, v = (torch.randn(rows, 8, dim, device=device, dtype=torch.bfloat16) for _ in range(3))
    try:
        ulysses.ulysses_attention(q, k, v, transport="copy_engine" if rank == 0 else "nccl")
        return "no error for transports that differ"
    except ValueError as e:
        want = (
            "ulysses: every rank must pass the same transport, got [copy_engine, "
            + ", ".join("nccl" for _ in range(world - 1))
            + "]"
        )
        if str(e) != want:
            return str(e)
    return _checks(rank, world, device)


@pytest.mark.parametrize("world", [2])
def test_nccl_copy_engine_equals_nccl_transport(world):
    nccl_ranks_ok(world, _same_as_nccl)


def _set_up_errors(rank, world, device):
    """A shape's first call inside capture, and a rank that cannot open its
    peers' memory: the documented errors on every rank alike, and the
    transport works afterwards."""
    rows, dim = 24, 64
    q, k, v = (torch.randn(rows, 8, dim, device=device, dtype=torch.bfloat16) for _ in range(3))
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            ulysses.ulysses_attention(q, k, v, validate=False, transport="copy_engine")
        return "no error for a first call inside capture"
    except ValueError as e:
        if str(e) != _peer.SET_UP_FIRST:
            return f"capture: {e}"
    torch.cuda.synchronize()

    class NoPeerOnRank1:  # attnprep._C, except that rank 1 cannot reach its peers
        def __getattr__(self, name):
            if name == "_peer_access" and rank == 1:
                return lambda device, peer: False
            return getattr(real, name)

    real = _peer._C
    _peer._C = NoPeerOnRank1()
    try:
        ulysses.ulysses_attention(q[:17], k[:17], v[:17], transport="copy_engine")
        return "no error without peer access"
    except ValueError as e:
        want = (
            'ulysses: transport="copy_engine" needs every rank\'s GPU on one node with peer access '
            "(rank 1: GPU 1 cannot access GPU 0)"
        )
        if str(e) != want:
            return f"peer access: {e}"
    finally:
        _peer._C = real
    got = ulysses.ulysses_attention(q, k, v, transport="copy_engine")
    if not torch.equal(got, ulysses.ulysses_attention(q, k, v)):
        return "differs from NCCL after the errors"
    return "ok"


@pytest.mark.parametrize("world", [2])
def test_nccl_copy_engine_set_up_errors(world):
    nccl_ranks_ok(world, _set_up_errors)


@pytest.mark.parametrize(
    "local_q, group, ratio, want",
    [
        (16, 1, 3.3, (1, 3, 11, 1)),
        (28, 1, 16.8, (1, 26, 1)),
        (40, 1, 2.0, (1, 2, 4, 8, 24, 1)),
        (12, 4, 5.0, (4, 4, 4)),
        (8, 4, 5.0, (8,)),
        (6, 1, 1.6, (1, 1, 1, 1, 1, 1)),
        (16, 1, 0.9, (16,)),
    ],
)
def test_growing_plan(local_q, group, ratio, want):
    assert _peer.growing_plan(local_q, group, ratio) == want
    assert sum(want) == local_q and all(n % group == 0 for n in want)


@pytest.mark.parametrize(
    "local_q, local_kv, split, sequence, want",
    [
        (16, 16, True, 16384, (1, 3, 11, 1)),
        (28, 28, True, 83968, (1, 26, 1)),
        (16, 4, True, 16384, (4, 8, 4)),
        (4, 1, False, 16384, (1, 2, 1)),
        (16, 16, True, 80, (16,)),
    ],
)
def test_auto_plan(local_q, local_kv, split, sequence, want):
    assert _peer.auto_plan(local_q, local_kv, split, sequence) == want


def _per_head(causal):
    """SDPA one q head at a time (with the kv head it uses): a head's result
    then does not depend on how many heads a call holds, so layers that
    split the heads differently must agree bit for bit."""
    attn = ulysses.sdpa(causal)

    def run(q, k, v):
        per_kv = q.shape[1] // k.shape[1]
        return torch.cat(
            [
                attn(q[:, h : h + 1], k[:, h // per_kv : h // per_kv + 1], v[:, h // per_kv : h // per_kv + 1])
                for h in range(q.shape[1])
            ],
            dim=1,
        )

    return run


def _uneven_plans_same(rank, world, device):
    """Uneven chunks over the copy engines (chunks="auto", and growing plans
    and a small first and last chunk given to the transport directly) against the NCCL layer, MHA
    and GQA split and replicated, on repeated calls and under graph replay;
    ranks that disagree on "auto" raise alike."""
    dim = 64
    for rows, heads, kv in [(40, 12, 12), (17, 24, 6), (33, 8, 1), (1, 6, 2), (8192, 8, 8)]:
        g = torch.Generator().manual_seed(heads + kv + rank)
        q, k, v = (torch.randn(rows, n, dim, generator=g).to(torch.bfloat16).to(device) for n in (heads, kv, kv))
        attn = _per_head(True)
        want = ulysses.ulysses_attention(q, k, v, attn_fn=attn)
        local_q, split = heads // world, kv >= world
        group = local_q // (kv // world) if split else 1
        edges = (group, local_q - 2 * group, group) if local_q >= 3 * group else (local_q,)  # small first and last
        plans = {_peer.growing_plan(local_q, group, 2.0), edges}
        for plan in sorted(plans):
            for call in range(2):
                got = _peer.attention(q, k, v, None, ulysses.layer._checked(attn), plan)
                if not torch.equal(got, want):
                    return f"({rows}, {heads}, {kv}) plan {plan} call {call}: differs"
        for call in range(2):
            got = ulysses.ulysses_attention(q, k, v, attn_fn=attn, chunks="auto", transport="copy_engine")
            if not torch.equal(got, want):
                return (
                    f"({rows}, {heads}, {kv}) auto call {call}: differs by {(got.float() - want.float()).abs().max()}"
                )
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = ulysses.ulysses_attention(
                q, k, v, attn_fn=attn, chunks="auto", transport="copy_engine", validate=False
            )
        for _ in range(2):
            got.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            if not torch.equal(got, want):
                return f"({rows}, {heads}, {kv}) auto replayed: differs"
    q, k, v = (torch.randn(8, 8, dim, device=device, dtype=torch.bfloat16) for _ in range(3))
    try:
        ulysses.ulysses_attention(q, k, v, chunks="auto" if rank == 0 else 2, transport="copy_engine")
        return "no error for chunks that differ"
    except ValueError as e:
        want = (
            "ulysses: every rank must pass the same chunks, got [auto, "
            + ", ".join("2" for _ in range(world - 1))
            + "]"
        )
        if str(e) != want:
            return str(e)
    return "ok"


@pytest.mark.parametrize("world", [2])
def test_nccl_copy_engine_uneven_plans(world):
    nccl_ranks_ok(world, _uneven_plans_same)
