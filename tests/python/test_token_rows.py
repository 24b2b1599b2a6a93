"""Per-token cos/sin: rope_pool_fused with positions=None reads row t of a
cos_sin_cache of T rows (a model's precomputed cos/sin); rope_cos_sin_rows
turns diffusers' forms into such rows. On the GPU: bit for bit the positions
path over the same rows, and diffusers' own apply_rotary_emb."""

import attnprep
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
KW = dict(head_dim=64, num_qo_heads=8, num_kv_heads=2, rope_base=1e4)
ROWS = "positions=None needs cos_sin_cache of one row per token, [num_tokens, rotary_dim] = [4, 64]"


def fake_call(cache_rows, T=4, **kw):
    with FakeTensorMode():
        q, k, v = (torch.empty(T, n, 64, device="cuda") for n in (8, 2, 2))
        slots = torch.zeros(T, dtype=torch.long, device="cuda")
        pools = (torch.empty(16, 2, 64, device="cuda"), torch.empty(16, 2, 64, device="cuda"))
        cache = None if cache_rows is None else torch.empty(cache_rows, 64, device="cuda")
        return attnprep.rope_pool_fused(q, k, v, None, slots, *pools, cos_sin_cache=cache, **KW, **kw)


def test_the_rows_must_be_one_per_token():
    q_rot, _, _, _ = fake_call(4)
    assert q_rot.shape == (4, 8, 64)
    for rows, note in ((None, "got no cos_sin_cache"), (5, "got torch.Size([5, 64])"), (3, "got torch.Size([3, 64])")):
        with pytest.raises(ValueError) as e:
            fake_call(rows)
        assert (
            str(e.value)
            == "positions=None needs cos_sin_cache of one row per token, [num_tokens, rotary_dim] = [4, 64]"
        )
        assert e.value.__notes__ == [note]


def test_the_earlier_checks_come_first():
    with pytest.raises(ValueError) as e:
        fake_call(None, norm_eps=0.0)  # check 37 before the per-token rows
    assert str(e.value) == "norm_eps must be a positive finite number, got 0"
    with pytest.raises(TypeError) as e:
        attnprep.rope_pool_fused(*[torch.empty(1)] * 3, [0], None, torch.empty(1), torch.empty(1), **KW)
    assert str(e.value) == "positions must be a torch.Tensor, got list"


def diffusers_cos_sin(S, D, theta=10000.0):
    embeddings = pytest.importorskip("diffusers.models.embeddings")
    pos = torch.arange(S, dtype=torch.float64) * 3 + 1
    cos, sin = embeddings.get_1d_rotary_pos_embed(D, pos, theta=theta, use_real=True, repeat_interleave_real=True)
    freqs_cis = embeddings.get_1d_rotary_pos_embed(D, pos, theta=theta, use_real=False)
    return cos, sin, freqs_cis


def test_rows_from_diffusers_forms():
    cos, sin, freqs_cis = diffusers_cos_sin(37, 128)
    rows = attnprep.rope_cos_sin_rows(cos, sin)
    assert rows.shape == (37, 128) and rows.dtype == torch.float32
    assert torch.equal(rows[:, :64], cos[:, ::2]) and torch.equal(rows[:, 64:], sin[:, ::2])
    assert torch.allclose(attnprep.rope_cos_sin_rows(freqs_cis), rows, rtol=0, atol=1e-6)
    halves = attnprep.rope_cos_sin_rows(
        torch.cat([cos[:, ::2]] * 2, 1), torch.cat([sin[:, ::2]] * 2, 1), pairs="halves"
    )
    assert torch.equal(halves, rows)


def test_rows_refuse_what_does_not_pair_up():
    cos, sin, _ = diffusers_cos_sin(5, 16)
    cases = [
        (
            (cos, sin),
            dict(pairs="halves"),
            'rope_cos_sin_rows: cos and sin are not repeated per pair as pairs="halves" says',
        ),
        ((cos, sin), dict(pairs="pairs"), 'rope_cos_sin_rows: pairs must be "adjacent" or "halves", got pairs'),
        ((cos, sin[:, :8]), {}, "rope_cos_sin_rows: cos and sin must both be [S, D] with D even"),
        ((cos,), {}, "rope_cos_sin_rows: cos and sin must both be [S, D] with D even"),
    ]
    for args, kw, message in cases:
        with pytest.raises(ValueError) as e:
            attnprep.rope_cos_sin_rows(*args, **kw)
        assert str(e.value) == message
    assert attnprep.rope_cos_sin_rows(cos, sin, pairs="halves", check=False).shape == (5, 16)


def case(T, dtype, hq=8, hkv=2, D=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, hq, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(T, hkv, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(T, hkv, D, device="cuda", dtype=dtype, generator=g)
    return q, k, v


@CUDA
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "qk_norm"])
@pytest.mark.parametrize("T", [1, 17, 1100])
def test_bit_for_bit_the_positions_path_over_the_same_rows(dtype, rows_dtype, is_neox, norm, T):
    q, k, v = case(T, dtype)
    table = attnprep.rope_cos_sin_cache(128, 5000, 1e4, dtype=rows_dtype, device="cuda")
    positions = torch.randint(0, 5000, (T,), device="cuda")
    wide = torch.empty(T, 160, device="cuda", dtype=rows_dtype)  # a row stride past rotary_dim
    wide[:, :128] = table[positions]
    rows = wide[:, :128]
    slots = torch.randperm(4 * T, device="cuda")[:T]
    kw = dict(head_dim=128, num_qo_heads=8, num_kv_heads=2, rope_base=1e4, is_neox=is_neox)
    if norm:
        kw.update(
            q_norm_weight=torch.rand(128, device="cuda") + 0.5, k_norm_weight=torch.rand(128, device="cuda") + 0.5
        )
    pools = [torch.full((4 * T, 2, 128), float("nan"), device="cuda", dtype=dtype) for _ in range(4)]
    want = attnprep.rope_pool_fused(q, k, v, positions, slots, pools[0], pools[1], cos_sin_cache=table, **kw)
    got = attnprep.rope_pool_fused(q, k, v, None, slots, pools[2], pools[3], cos_sin_cache=rows, **kw)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@CUDA
def test_paged_fp8_pools_and_graphs():
    T = 33
    q, k, v = case(T, torch.bfloat16)
    table = attnprep.rope_cos_sin_cache(128, 64, 1e6, device="cuda")
    positions = torch.randint(0, 64, (T,), device="cuda")
    rows = table[positions].clone()
    slots = torch.randperm(256, device="cuda")[:T]
    scale = torch.tensor(0.5, device="cuda")
    kw = dict(head_dim=128, num_qo_heads=8, num_kv_heads=2, rope_base=1e6, k_scale=scale, v_scale=scale)
    pools = [torch.zeros(16, 16, 2, 128, device="cuda", dtype=torch.float8_e4m3fn) for _ in range(4)]
    want = attnprep.rope_pool_fused(q, k, v, positions, slots, pools[0], pools[1], cos_sin_cache=table, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = attnprep.rope_pool_fused(q, k, v, None, slots, pools[2], pools[3], cos_sin_cache=rows, **kw)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    compiled = torch.compile(
        lambda q, k, v: attnprep.rope_pool_fused(q, k, v, None, slots, pools[2], pools[3], cos_sin_cache=rows, **kw),
        fullgraph=True,
    )
    q_rot, k_rot, _, _ = compiled(q, k, v)
    assert torch.equal(q_rot, want[0]) and torch.equal(k_rot, want[1])


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_diffusers_apply_rotary_emb(dtype):
    """Flux's form: adjacent pairs, real cos/sin repeated per pair, float32 inside, one rounding."""
    embeddings = pytest.importorskip("diffusers.models.embeddings")
    S, H, D = 77, 4, 128
    cos, sin, _ = diffusers_cos_sin(S, D)
    cos, sin = cos.float().cuda(), sin.float().cuda()
    q, k, v = case(S, dtype, hq=H, hkv=H, D=D)
    want_q = embeddings.apply_rotary_emb(q.transpose(0, 1)[None], (cos, sin))[0].transpose(0, 1)
    pools = (torch.zeros(S, H, D, device="cuda", dtype=dtype), torch.zeros(S, H, D, device="cuda", dtype=dtype))
    slots = torch.full((S,), -1, device="cuda")
    rows = attnprep.rope_cos_sin_rows(cos, sin)
    got_q, _, _, _ = attnprep.rope_pool_fused(
        q,
        k,
        v,
        None,
        slots,
        *pools,
        head_dim=D,
        num_qo_heads=H,
        num_kv_heads=H,
        rope_base=1.0,
        is_neox=False,
        cos_sin_cache=rows,
    )
    # both compute x * cos + rot(x) * sin in float32 and round once; diffusers without a fused multiply-add
    err = (got_q.double() - want_q.double()).abs().max().item()
    ulp = torch.finfo(dtype).eps * want_q.double().abs().max().item()
    assert err <= (ulp if dtype == torch.bfloat16 else 4 * ulp)
