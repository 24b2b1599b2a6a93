"""rope_pool_fused with the per-head QK RMSNorm (docs/contract.md): messages,
the normalized values bit for bit against attnprep.testing.rms_norm_reference,
norm + RoPE against the float64 rotation of them, every KV format, graphs,
torch.compile, and transformers' own Qwen3 and Gemma 3 norm + RoPE."""

import math

import attnprep
import pytest
import torch
from attnprep.testing import cos_sin, pool_write_reference, rms_norm_reference, rope_error_ratio, rope_reference
from conftest import poison_like, requires_cuda, rope_schema_args, same_bits
from torch._subclasses.fake_tensor import FakeTensorMode

KW = dict(head_dim=64, num_qo_heads=8, num_kv_heads=2, rope_base=1e4)

# ---------------------------------------------------------------- messages (fake CUDA tensors: no GPU needed)


def fake_call(**over):
    with FakeTensorMode():
        a = dict(
            q=torch.empty(4, 8, 64, device="cuda"),
            k=torch.empty(4, 2, 64, device="cuda"),
            v=torch.empty(4, 2, 64, device="cuda"),
            positions=torch.zeros(4, dtype=torch.long, device="cuda"),
            slots=torch.zeros(4, dtype=torch.long, device="cuda"),
            k_pool=torch.empty(16, 2, 64, device="cuda"),
            v_pool=torch.empty(16, 2, 64, device="cuda"),
        )
        kw = dict(KW, q_norm_weight=torch.ones(64, device="cuda"), k_norm_weight=torch.ones(64, device="cuda"))
        for key, val in over.items():
            val = val() if callable(val) else val
            (a if key in a else kw)[key] = val
        return attnprep.rope_pool_fused(*a.values(), **kw)


def expect(exc, msg, **over):
    with pytest.raises(exc) as e:
        fake_call(**over)
    assert str(e.value) == msg


def weight(*shape, dtype=torch.float32, device="cuda"):
    return lambda: torch.ones(*shape, dtype=dtype, device=device)


def test_messages_in_order():
    fake_call()
    fake_call(q_norm_weight=None, k_norm_weight=weight(64, dtype=torch.float32))
    fake_call(
        q=lambda: torch.empty(4, 8, 64, device="cuda", dtype=torch.bfloat16),
        k=lambda: torch.empty(4, 2, 64, device="cuda", dtype=torch.bfloat16),
        v=lambda: torch.empty(4, 2, 64, device="cuda", dtype=torch.bfloat16),
        k_pool=lambda: torch.empty(16, 2, 64, device="cuda", dtype=torch.bfloat16),
        v_pool=lambda: torch.empty(16, 2, 64, device="cuda", dtype=torch.bfloat16),
        q_norm_weight=weight(64, dtype=torch.bfloat16),
    )
    expect(ValueError, "rope_pool_fused expects all tensors on one device", k_norm_weight=weight(64, device="cpu"))
    expect(
        ValueError,
        "q_norm_weight and k_norm_weight must have shape [head_dim] = [64], got torch.Size([128])",
        q_norm_weight=weight(128),
    )
    expect(
        ValueError,
        "q_norm_weight and k_norm_weight must have shape [head_dim] = [64], got torch.Size([1, 64])",
        k_norm_weight=weight(1, 64),
    )
    expect(
        ValueError,
        "q_norm_weight and k_norm_weight must be float32 or q's dtype (torch.float32), got torch.bfloat16",
        k_norm_weight=weight(64, dtype=torch.bfloat16),
    )
    expect(
        ValueError,
        "q_norm_weight and k_norm_weight must be contiguous",
        q_norm_weight=lambda: torch.empty_strided((64,), (2,), device="cuda"),
    )
    for eps, shown in [(0.0, "0"), (-1, "-1"), (1e-50, "1e-50"), (float("nan"), "nan"), (float("inf"), "inf")]:
        expect(ValueError, f"norm_eps must be a positive finite number, got {shown}", norm_eps=eps)
    expect(
        ValueError,
        "norm_eps must be a positive finite number, got -1",
        norm_eps=-1,
        q_norm_weight=None,
        k_norm_weight=None,
    )
    expect(ValueError, "norm_weight_offset must be finite, got inf", norm_weight_offset=float("inf"))
    # an earlier check wins
    expect(
        ValueError,
        "q_norm_weight and k_norm_weight must have shape [head_dim] = [64], got torch.Size([128])",
        q_norm_weight=weight(128),
        norm_eps=-1,
    )


def test_argument_types():
    a = (
        torch.randn(4, 8, 64),
        torch.randn(4, 2, 64),
        torch.randn(4, 2, 64),
        torch.arange(4),
        torch.arange(4),
        torch.zeros(16, 2, 64),
        torch.zeros(16, 2, 64),
    )
    for over, exc, msg in [
        (dict(q_norm_weight=1.0), TypeError, "q_norm_weight must be a torch.Tensor, got float"),
        (dict(k_norm_weight=[1]), TypeError, "k_norm_weight must be a torch.Tensor, got list"),
        (dict(norm_eps="1e-6"), TypeError, "rope_pool_fused: norm_eps must be a number, got str"),
        (
            dict(norm_weight_offset=None),
            TypeError,
            "rope_pool_fused: norm_weight_offset must be a number, got NoneType",
        ),
        ({}, ValueError, "rope_pool_fused expects CUDA or MPS tensors"),
    ]:
        with pytest.raises(exc) as e:
            attnprep.rope_pool_fused(*a, **{**KW, "q_norm_weight": torch.ones(64), **over})
        assert str(e.value) == msg


@requires_cuda
def test_weights_overlapping_what_the_op_writes_are_refused():
    T = 4
    q, k, v = (
        torch.randn(T, 8, 64, device="cuda"),
        torch.randn(T, 2, 64, device="cuda"),
        torch.randn(T, 2, 64, device="cuda"),
    )
    positions, slots = torch.arange(T, device="cuda"), torch.arange(T, device="cuda")
    k_pool, v_pool = torch.zeros(16, 2, 64, device="cuda"), torch.zeros(16, 2, 64, device="cuda")
    msg = "k_pool and v_pool (and q and k with inplace=True) must not overlap q_norm_weight or k_norm_weight"
    before = [t.clone() for t in (q, k, k_pool)]
    for w, inplace in [(k_pool[3, 1], False), (q[0, 0], True)]:
        with pytest.raises(ValueError) as e:
            attnprep.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, **KW, k_norm_weight=w, inplace=inplace)
        assert str(e.value) == msg
    assert all(same_bits(a, b) for a, b in zip(before, (q, k, k_pool)))
    # reading a weight out of q is fine when q is not written
    attnprep.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, **KW, k_norm_weight=q[0, 0])


# ---------------------------------------------------------------- the reference's arithmetic (CPU)


def test_reference_sums_pairwise_over_the_padded_head():
    # 1 + seven 2^-24 squares: pairwise gives 1 + 3 * 2^-23, a running sum stays at 1
    x = torch.full((1, 8), 2.0**-12)
    x[0, 0] = 1.0
    ss = torch.tensor(1.0 + 3 * 2.0**-23, dtype=torch.float32)
    want = 1.0 / torch.sqrt(ss / 8 + torch.tensor(1e-6, dtype=torch.float32))
    assert torch.equal(rms_norm_reference(x, torch.ones(8))[0, 0], want)
    # head_dim 3: padded to 4, ((1 + 4) + (9 + 0))
    x = torch.tensor([[1.0, -2.0, 3.0]])
    inv = 1.0 / torch.sqrt(torch.tensor(14.0) / 3 + torch.tensor(1e-6))
    assert torch.equal(rms_norm_reference(x, torch.tensor([1.0, 2.0, 0.5])), (x * inv) * torch.tensor([1.0, 2.0, 0.5]))
    assert torch.equal(
        rms_norm_reference(x, torch.tensor([1.0, 2.0, 0.5]), offset=1.0), (x * inv) * torch.tensor([2.0, 3.0, 1.5])
    )


# transformers' RMSNorm modules of the two conventions, where transformers is installed
def hf_norms():
    tf = pytest.importorskip("transformers")
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    return tf, Qwen3RMSNorm, Gemma3RMSNorm


def ulps_apart(a, b):
    """Largest distance in units in the last place of a's dtype (a, b same dtype, finite)."""
    fa, fb = a.float(), b.float()
    ulp = torch.finfo(a.dtype).eps * torch.exp2(
        torch.floor(torch.log2(torch.maximum(fa.abs(), fb.abs()).clamp(min=torch.finfo(a.dtype).tiny)))
    )
    return ((fa - fb).abs() / ulp).max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("style", ["qwen3", "gemma3"])
def test_reference_matches_transformers_norm_modules(dtype, style):
    """The contract's float32 steps are the models' own, up to their sum order and rsqrt."""
    _, Qwen3RMSNorm, Gemma3RMSNorm = hf_norms()
    g = torch.Generator().manual_seed(0)
    D = 128
    x = (3 * torch.randn(64, 8, D, generator=g)).to(dtype)
    if style == "qwen3":
        m = Qwen3RMSNorm(D, eps=1e-6).to(dtype)
        offset = 0.0
    else:
        m = Gemma3RMSNorm(D, eps=1e-6).to(dtype)
        offset = 1.0
    with torch.no_grad():
        m.weight.copy_((0.5 + torch.rand(D, generator=g)).to(dtype))
        want = m(x)
    got = rms_norm_reference(x, m.weight, 1e-6, offset)
    assert got.dtype == dtype
    # Qwen3 rounds twice (T(x inv), then T(w ...)): a float32 difference that
    # moves the first rounding moves the result by w ulp of it, up to 2 ulp of
    # the output's binade; Gemma rounds once: 1 ulp
    # the same; float32 outputs: their inv differs by a few float32 ulp
    # (another sum order, 1/sqrt rounded twice)
    if dtype == torch.float32:
        assert ulps_apart(got, want) <= 8.0
    else:
        assert ulps_apart(got, want) <= (2.0 if offset == 0.0 else 1.0)
        assert (got == want).float().mean().item() > 0.95


# ---------------------------------------------------------------- on the GPU


def case(T, hq, hkv, D, dtype, seed=0, w_dtype=torch.float32, fused=False):
    g = torch.Generator().manual_seed(seed)
    if fused:  # slices of one projection: strided q, k, v
        qkv = (2 * torch.randn(T, (hq + 2 * hkv) * D, generator=g)).to(dtype).cuda()
        q, k, v = (t.view(T, -1, D) for t in qkv.split([hq * D, hkv * D, hkv * D], dim=1))
    else:
        q = (2 * torch.randn(T, hq, D, generator=g)).to(dtype).cuda()
        k = (2 * torch.randn(T, hkv, D, generator=g)).to(dtype).cuda()
        v = torch.randn(T, hkv, D, generator=g).to(dtype).cuda()
    wq = (0.5 + torch.rand(D, generator=g)).to(w_dtype).cuda()
    wk = (0.5 + torch.rand(D, generator=g)).to(w_dtype).cuda()
    positions = torch.randint(0, 1 << 16, (T,), generator=g).cuda()
    slots = torch.randperm(2 * T + 3, generator=g)[:T].cuda()
    slots[1::5] = -1
    return q, k, v, positions, slots, wq, wk


def run(
    q,
    k,
    v,
    positions,
    slots,
    wq,
    wk,
    *,
    rot=None,
    is_neox=True,
    offset=0.0,
    eps=1e-6,
    cache=None,
    inplace=False,
    k_pool=None,
    v_pool=None,
    kv_layout="NHD",
    scales=None,
):
    T, hq, D = q.shape
    hkv = k.shape[1]
    rot = rot or D
    if k_pool is None:
        k_pool = poison_like((2 * T + 3, hkv, D), q.dtype, "cuda")
        v_pool = poison_like((2 * T + 3, hkv, D), q.dtype, "cuda")
    kp0, vp0 = k_pool.clone(), v_pool.clone()
    q_in, k_in = q.clone(), k.clone()
    out = attnprep.rope_pool_fused(
        q,
        k,
        v,
        positions,
        slots,
        k_pool,
        v_pool,
        head_dim=D,
        num_qo_heads=hq,
        num_kv_heads=hkv,
        rope_base=1e4,
        rotary_dim=None if rot == D else rot,
        is_neox=is_neox,
        cos_sin_cache=cache,
        inplace=inplace,
        q_norm_weight=wq,
        k_norm_weight=wk,
        norm_eps=eps,
        norm_weight_offset=offset,
        kv_layout=kv_layout,
        **(scales or {}),
    )
    q_rot, k_rot = out[0], out[1]
    if inplace:
        assert q_rot is q and k_rot is k
    qn = rms_norm_reference(q_in, wq, eps, offset) if wq is not None else q_in.cpu()
    kn = rms_norm_reference(k_in, wk, eps, offset) if wk is not None else k_in.cpu()
    cos, sin = cos_sin(positions, rot, 1e4, cache)
    for got, n in ((q_rot, qn), (k_rot, kn)):
        ratio = rope_error_ratio(got, rope_reference(n, cos, sin, rot, is_neox), n, rot, is_neox)
        assert ratio <= 1.0, f"error {ratio:.3g}x the bound"
    scale = scales or {}
    assert same_bits(k_pool, pool_write_reference(kp0, k_rot, slots, kv_layout, scale.get("k_scale")))
    assert same_bits(v_pool, pool_write_reference(vp0, v, slots, kv_layout, scale.get("v_scale")))
    return q_rot, k_rot, qn, kn


DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [2, 16, 64, 80, 128, 256, 512])
@pytest.mark.parametrize(
    "offset, w_same", [(0.0, False), (0.0, True), (1.0, True)], ids=["qwen3-f32w", "qwen3", "gemma"]
)
@pytest.mark.parametrize("with_cache", [False, True], ids=["rope_base", "cache"])
def test_normalized_values_are_bit_exact(dtype, D, offset, w_same, with_cache):
    """Position 0 rotates by the identity: q_rot/k_rot are the normalized heads,
    equal to the reference bit for bit (with a cos_sin_cache the CUDA kernel
    reads the weights from their tensors instead of staging them)."""
    q, k, v, positions, slots, wq, wk = case(37, 6, 2, D, dtype, seed=D, w_dtype=dtype if w_same else torch.float32)
    positions.zero_()
    cache = attnprep.rope_cos_sin_cache(D, 4, 1e4, device="cuda") if with_cache else None
    q_rot, k_rot, qn, kn = run(q, k, v, positions, slots, wq, wk, offset=offset, cache=cache)
    assert torch.equal(q_rot.cpu(), qn) and torch.equal(k_rot.cpu(), kn)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_cache", [False, True], ids=["rope_base", "cache"])
def test_weights_down_to_subnormal_products_are_bit_exact(dtype, with_cache):
    """Weights in q's dtype from its smallest subnormal to near its largest
    finite value, normalized values over 13 binades: the products are
    subnormal, tiny, or large in q's dtype, and still the reference's bit for
    bit (with a cos_sin_cache the CUDA kernel multiplies them as pairs in q's
    dtype, rounding once)."""
    D = 128
    q, k, v, positions, slots, _, _ = case(41, 6, 2, D, dtype, seed=5)
    positions.zero_()
    g = torch.Generator().manual_seed(6)
    info = torch.finfo(dtype)
    tiny = math.log2(info.smallest_normal) - {torch.float16: 10, torch.bfloat16: 7}[dtype]  # the smallest subnormal
    big = math.log2(info.max) - 5  # |normalized| <= sqrt(128) < 2^4: no overflow
    exps = torch.cat([torch.linspace(tiny, tiny + 14, D // 2), torch.linspace(big - 14, big, D // 2)]).round()
    sign = torch.where(torch.rand(D, generator=g) < 0.5, -1.0, 1.0)
    wq = (sign * torch.exp2(exps)).to(dtype).cuda()
    wk = wq.flip(0).contiguous()
    assert (wq.float().abs() < info.smallest_normal).any()
    q, k = (
        (x.float().cpu() * torch.exp2(-torch.randint(0, 13, x.shape, generator=g).float())).to(dtype).cuda()
        for x in (q, k)
    )
    cache = attnprep.rope_cos_sin_cache(D, 4, 1e4, device="cuda") if with_cache else None
    q_rot, k_rot, qn, kn = run(q, k, v, positions, slots, wq, wk, cache=cache)
    assert (qn.float().abs() < info.smallest_normal).logical_and(qn != 0).any()
    assert torch.equal(q_rot.cpu(), qn) and torch.equal(k_rot.cpu(), kn)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("T", [1, 17, 65, 1100, 3001])
@pytest.mark.parametrize("heads", [(32, 8), (64, 8), (5, 1)], ids=str)
def test_norm_then_rope(dtype, is_neox, T, heads):
    run(*case(T, heads[0], heads[1], 128, dtype, seed=T), is_neox=is_neox, offset=0.0 if T % 2 else 1.0)


@requires_cuda
@pytest.mark.parametrize(
    "D, heads", [(64, (5, 1)), (128, (5, 1)), (128, (64, 8)), (256, (5, 1)), (512, (5, 1))], ids=str
)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize(
    "w_dtype, offset",
    [(torch.bfloat16, 0.0), (torch.float32, 0.0), (torch.bfloat16, 1.0)],
    ids=["qwen3", "qwen3-f32w", "gemma"],
)
def test_table_warp_blocks_match_whole_token_blocks(D, heads, is_neox, w_dtype, offset):
    """Computing cos/sin, a small call's one-round blocks have a table warp
    (RopeCudaPolicy::table_warp_threads, core::rope_table_warp) that computes
    the token's cos/sin table (the first 64 inverse frequencies parked before
    the PDL wait, head_dim 256's and 512's others read after it) and stages
    the norm weights while the item warps normalize. Their tokens match the
    reference and, bit for bit, the same tokens inside a call of 1100 (whole-
    token blocks, or blocks past one wave: one table behind __syncthreads)."""
    q, k, v, positions, slots, wq, wk = case(1100, heads[0], heads[1], D, torch.bfloat16, seed=D, w_dtype=w_dtype)
    whole = run(q, k, v, positions, slots, wq, wk, is_neox=is_neox, offset=offset)
    for T in (1, 37):
        small = run(
            q[:T], k[:T], v[:T], positions[:T], torch.arange(T, device="cuda"), wq, wk, is_neox=is_neox, offset=offset
        )
        assert same_bits(small[0], whole[0][:T]) and same_bits(small[1], whole[1][:T])


@requires_cuda
@pytest.mark.parametrize("rot", [32, 64, 6, 2])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_partial_rotary_normalizes_the_passed_through_part(rot, is_neox, dtype):
    run(*case(33, 8, 2, 128, dtype, seed=rot), rot=rot, is_neox=is_neox)


@requires_cuda
@pytest.mark.parametrize("which", ["q", "k"])
@pytest.mark.parametrize("with_cache", [False, True], ids=["rope_base", "cache"])
def test_one_side_only(which, with_cache):
    q, k, v, positions, slots, wq, wk = case(65, 8, 2, 128, torch.bfloat16)
    cache = attnprep.rope_cos_sin_cache(128, 1 << 16, 1e4, device="cuda") if with_cache else None
    run(q, k, v, positions, slots, wq if which == "q" else None, wk if which == "k" else None, cache=cache)


@requires_cuda
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T", [65, 1500])
def test_cos_sin_cache_with_weights_off_16_bytes(w_dtype, T):
    """Weights that do not start on 16 bytes: the kernel stages them (the block
    table path) instead of reading them 16 bytes at a time."""
    q, k, v, positions, slots, wq, wk = case(T, 32, 8, 128, torch.bfloat16, seed=T, w_dtype=w_dtype)
    buf = torch.empty(2 * 128 + 2, dtype=w_dtype, device="cuda")
    wq_odd, wk_odd = buf[1:129], buf[129:257]
    wq_odd.copy_(wq)
    wk_odd.copy_(wk)
    cache = attnprep.rope_cos_sin_cache(128, 1 << 16, 1e4, device="cuda")
    run(q, k, v, positions, slots, wq_odd, wk_odd, cache=cache, offset=1.0 if T > 100 else 0.0)


@requires_cuda
@pytest.mark.parametrize("T", [33, 2048])
def test_inplace_strided_and_misaligned(T):
    run(*case(T, 16, 4, 128, torch.bfloat16, fused=True), inplace=True)
    q, k, v, positions, slots, wq, wk = case(T, 8, 2, 128, torch.bfloat16)
    buf = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")
    q_odd = buf[1:].view(q.shape)  # 2-byte aligned: one element per access
    q_odd.copy_(q)
    run(q_odd, k, v, positions, slots, wq, wk)


@requires_cuda
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T, hq, hkv", [(65, 8, 2), (1500, 32, 8)])  # one round per block; three
def test_cos_sin_cache_and_eps(T, hq, hkv, cache_dtype):
    q, k, v, positions, slots, wq, wk = case(T, hq, hkv, 128, torch.bfloat16)
    cache = attnprep.rope_cos_sin_cache(
        128,
        1 << 16,
        1e6,
        scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        dtype=cache_dtype,
        device="cuda",
    )
    run(q, k, v, positions, slots, wq, wk, cache=cache, eps=1e-2)
    # all-zero heads: 0 * 1/sqrt(eps) = 0, never NaN
    z = torch.zeros_like(q)
    q_rot = run(z, k, v, positions, slots, wq, wk)[0]
    assert torch.equal(q_rot, z)


@requires_cuda
@pytest.mark.parametrize("D", [64, 256, 512])
@pytest.mark.parametrize("T", [37, 1100])  # split tokens; whole tokens (2-3 rounds from head_dim 256)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "offset, w_same", [(0.0, True), (0.0, False), (1.0, True)], ids=["qwen3", "qwen3-f32w", "gemma"]
)
def test_cache_rows_at_every_head_dim(D, T, cache_dtype, offset, w_same):
    """With a cos_sin_cache each warp of the CUDA kernel copies the token's
    row (and 2-byte Llama-style weights) into shared memory, a lane per 16
    bytes: at head_dim 64 half the lanes copy nothing, at 256 and 512 a lane
    copies several chunks. The rotation stays within the bound, and at
    position 0 (the identity) the outputs are the normalized values bit for
    bit."""
    q, k, v, positions, slots, wq, wk = case(
        T, 8, 2, D, torch.bfloat16, seed=D + T, w_dtype=torch.bfloat16 if w_same else torch.float32
    )
    cache = attnprep.rope_cos_sin_cache(D, 1 << 16, 1e4, dtype=cache_dtype, device="cuda")
    run(q, k, v, positions, slots, wq, wk, offset=offset, cache=cache)
    positions.zero_()
    q_rot, k_rot, qn, kn = run(q, k, v, positions, slots, wq, wk, offset=offset, cache=cache)
    assert torch.equal(q_rot.cpu(), qn) and torch.equal(k_rot.cpu(), kn)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T, hq, hkv", [(1100, 32, 8), (1100, 24, 8), (1300, 64, 8)])  # 3, 3 (last partial), 5 rounds
@pytest.mark.parametrize("sides", ["both", "q", "k"])
def test_cache_rows_with_weights_in_q_dtype_over_several_rounds(dtype, T, hq, hkv, sides):
    """Whole tokens of several rounds on the cache-row path, weights in q's
    dtype with the Qwen3 rounding: there each item's weights are loaded with
    its data, q's and k's (distinct here) by the item's side."""
    q, k, v, positions, slots, wq, wk = case(T, hq, hkv, 128, dtype, seed=T + hq, w_dtype=dtype)
    cache = attnprep.rope_cos_sin_cache(128, 1 << 16, 1e4, device="cuda")
    run(q, k, v, positions, slots, wq if sides != "k" else None, wk if sides != "q" else None, cache=cache)


@requires_cuda
@pytest.mark.parametrize("hq", [32, 64])  # 3 and 5 rounds a token
@pytest.mark.parametrize("extra", [1, 700])
@pytest.mark.parametrize("with_cache", [True, False], ids=["cache", "rope_base"])
@pytest.mark.parametrize("w_dtype, offset", [(torch.bfloat16, 0.0), (torch.float32, 1.0)], ids=["qwen3", "gemma"])
def test_last_wave_in_one_round_slices(hq, extra, with_cache, w_dtype, offset):
    """Past one wave of whole-token blocks (RopeCudaPolicy: 9 blocks of 128
    threads per multiprocessor with the QK norm; 10 for tokens of at most 3
    rounds, norm_short_token_max_rounds), a call's last
    tokens go in one-round slices (core::plan_rope_cuda_tail; half as many
    for those short tokens, norm_short_token_tail_share). They match the
    reference, and bit for bit what the same tokens give in whole-token
    blocks: the call again with its tokens in reverse order."""
    per_sm = 10 if hq == 32 else 9
    resident = per_sm * torch.cuda.get_device_properties(0).multi_processor_count
    q, k, v, positions, slots, wq, wk = case(resident + extra, hq, 8, 128, torch.bfloat16, seed=extra, w_dtype=w_dtype)
    cache = attnprep.rope_cos_sin_cache(128, 1 << 16, 1e4, device="cuda") if with_cache else None
    got = run(q, k, v, positions, slots, wq, wk, cache=cache, offset=offset)
    flip = [x.flip(0) for x in (q, k, v, positions, slots)]
    got_flipped = run(*flip, wq, wk, cache=cache, offset=offset)
    for a, b in zip(got[:2], got_flipped[:2]):
        assert same_bits(a, b.flip(0))


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sides", ["both", "q", "k"])
def test_cache_rows_in_one_round_staged_and_not(dtype, cache_dtype, sides):
    """Split tokens (one round per block) on the cache-row path: small calls
    stage each thread's weights and cos/sin in shared memory
    (RopeCudaPolicy::norm_stage_max_blocks_per_sm: 5 blocks per
    multiprocessor), larger ones read them directly. A call of the last
    staged size and one token more (32/8 heads: 3 blocks a token) both match
    the reference, and their common tokens agree bit for bit."""
    per_sm = 5
    staged = per_sm * torch.cuda.get_device_properties(0).multi_processor_count // 3
    assert staged + 1 < 1024  # both still split into one-round blocks
    q, k, v, positions, slots, wq, wk = case(staged + 1, 32, 8, 128, dtype, seed=7, w_dtype=dtype)
    positions[-1] = positions[0]  # the extra token's cos/sin row is one the staged call reads too
    cache = attnprep.rope_cos_sin_cache(128, 1 << 16, 1e4, dtype=cache_dtype, device="cuda")
    wq, wk = (wq if sides != "k" else None), (wk if sides != "q" else None)
    big = run(q, k, v, positions, slots, wq, wk, cache=cache)
    small = run(q[:staged], k[:staged], v[:staged], positions[:staged], slots[:staged], wq, wk, cache=cache)
    for got_small, got_big in zip(small[:2], big[:2]):
        assert same_bits(got_small, got_big[:staged])


@requires_cuda
@pytest.mark.parametrize("layout, page_size", [("NHD", 16), ("HND", 64)])
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_paged_and_fp8_pools(layout, page_size, pool_dtype):
    T, hkv = 65, 8
    q, k, v, positions, slots, wq, wk = case(T, 32, hkv, 128, torch.bfloat16)
    pages = 16
    shape = (pages, page_size, hkv, 128) if layout == "NHD" else (pages, hkv, page_size, 128)
    buf = poison_like((pages, 2) + shape[1:], pool_dtype, "cuda")  # one combined cache
    slots = torch.randperm(pages * page_size)[:T].cuda()
    slots[2::9] = -1
    scales = None
    if pool_dtype != torch.bfloat16:
        scales = dict(k_scale=torch.full((hkv,), 0.25, device="cuda"), v_scale=torch.tensor(0.5, device="cuda"))
    run(q, k, v, positions, slots, wq, wk, k_pool=buf[:, 0], v_pool=buf[:, 1], kv_layout=layout, scales=scales)


@requires_cuda
def test_empty():
    q, k, v, positions, slots, wq, wk = case(1, 8, 2, 128, torch.bfloat16)
    e = lambda t: t[:0]  # noqa: E731
    out = attnprep.rope_pool_fused(
        e(q),
        e(k),
        e(v),
        e(positions),
        e(slots),
        torch.zeros(4, 2, 128, device="cuda", dtype=torch.bfloat16),
        torch.zeros(4, 2, 128, device="cuda", dtype=torch.bfloat16),
        head_dim=128,
        num_qo_heads=8,
        num_kv_heads=2,
        rope_base=1e4,
        q_norm_weight=wq,
        k_norm_weight=wk,
    )
    assert out[0].shape == (0, 8, 128)


@requires_cuda
def test_cuda_graph_replay_with_weights_updated_between_replays():
    q, k, v, positions, slots, wq, wk = case(64, 32, 8, 128, torch.bfloat16)
    k_pool = torch.zeros(131, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    kw = dict(head_dim=128, num_qo_heads=32, num_kv_heads=8, rope_base=1e4, q_norm_weight=wq, k_norm_weight=wk)
    attnprep.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, **kw)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q_rot, k_rot, _, _ = attnprep.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, **kw)
    for seed in range(3):
        fresh = case(64, 32, 8, 128, torch.bfloat16, seed=50 + seed)
        for dst, src in zip((q, k, v, positions, slots, wq, wk), fresh):
            dst.copy_(src)
        g.replay()
        torch.cuda.synchronize()
        want = attnprep.rope_pool_fused(q, k, v, positions, slots, k_pool.clone(), v_pool.clone(), **kw)
        assert same_bits(q_rot, want[0]) and same_bits(k_rot, want[1])
        ok = slots >= 0
        assert same_bits(k_pool[slots[ok]], k_rot[ok])


@requires_cuda
@pytest.mark.parametrize("inplace", [False, True])
def test_torch_compile_fullgraph(inplace):
    q, k, v, positions, slots, wq, wk = case(17, 8, 2, 64, torch.bfloat16)
    k_pool = torch.zeros(40, 2, 64, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    kw = dict(
        head_dim=64,
        num_qo_heads=8,
        num_kv_heads=2,
        rope_base=1e4,
        inplace=inplace,
        norm_eps=1e-5,
        norm_weight_offset=1.0,
    )

    def f(q, k, v, positions, slots, k_pool, v_pool, wq, wk):
        out = attnprep.rope_pool_fused(
            q * 1, k * 1, v, positions, slots, k_pool, v_pool, q_norm_weight=wq, k_norm_weight=wk, **kw
        )
        return out[0] + 1, out[1].float().sum()

    kp2, vp2 = k_pool.clone(), v_pool.clone()
    got = torch.compile(f, fullgraph=True)(q, k, v, positions, slots, k_pool, v_pool, wq, wk)
    want = f(q, k, v, positions, slots, kp2, vp2, wq, wk)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert same_bits(k_pool, kp2) and same_bits(v_pool, vp2)


@requires_cuda
def test_opcheck():
    q, k, v, positions, slots, wq, wk = case(9, 8, 2, 64, torch.float16, w_dtype=torch.float16)
    k_pool = torch.zeros(21, 2, 64, device="cuda", dtype=torch.float16)
    v_pool = torch.zeros_like(k_pool)
    norm = dict(q_norm_weight=wq, k_norm_weight=wk, norm_weight_offset=1.0)
    args = rope_schema_args(q, k, v, positions, slots, k_pool, v_pool, **norm)
    torch.library.opcheck(torch.ops.attnprep.rope_pool_fused.default, args)


# ---------------------------------------------------------------- against transformers' models


def model_error_ratio(got, want, n):
    """max |got - want| / (ulp(want) + c eps |pair|): c = 2 for 16-bit outputs
    (the model rounds its norm twice), 8 for float32 (NeoX pairs)."""
    got, want, x = got.double().cpu(), want.double().cpu(), n.double().cpu().abs()
    h = x.shape[-1] // 2
    pair = torch.cat([x[..., :h] + x[..., h:], x[..., h:] + x[..., :h]], -1)
    fi = torch.finfo(n.dtype)
    ulp = fi.eps * torch.exp2(torch.floor(torch.log2(want.abs().clamp(min=fi.tiny))))
    bound = ulp + (8 if n.dtype == torch.float32 else 2) * fi.eps * pair
    return ((got - want).abs() / bound).max().item()


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_matches_transformers_norm_then_rope(dtype, family):
    """q/k through the model's own q_norm/k_norm and its RoPE (transformers'
    apply_rotary_pos_emb, here in float32 on the normalized values: in the
    model's dtype it rounds each product) against one fused call: within 1
    ulp of the output dtype, plus 1 ulp of the pair's inputs where the
    model's norm (another sum order, an approximate rsqrt) rounds the other
    way; float32: a few float32 ulp of the pair."""
    tf, Qwen3RMSNorm, Gemma3RMSNorm = hf_norms()
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    T, hq, hkv, D = 77, 64, 8, 128
    g = torch.Generator().manual_seed(1)
    norm_cls, offset = (Qwen3RMSNorm, 0.0) if family == "qwen3" else (Gemma3RMSNorm, 1.0)
    q_norm, k_norm = norm_cls(D, eps=1e-6).to(dtype).cuda(), norm_cls(D, eps=1e-6).to(dtype).cuda()
    with torch.no_grad():
        for m in (q_norm, k_norm):
            m.weight.copy_((0.2 * torch.randn(D, generator=g) + (0.0 if offset else 1.0)).to(dtype))
    q = (3 * torch.randn(T, hq, D, generator=g)).to(dtype).cuda()
    k = (3 * torch.randn(T, hkv, D, generator=g)).to(dtype).cuda()
    v = torch.randn(T, hkv, D, generator=g).to(dtype).cuda()
    positions = torch.randint(0, 40000, (T,), generator=g).cuda()
    cache = attnprep.rope_cos_sin_cache(D, 40000, 1e6, device="cuda")
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    with torch.no_grad():
        qn, kn = q_norm(q), k_norm(k)  # [T, H, D]: the model's own modules
        # transformers' RoPE, [batch, heads, seq, D]
        want_q, want_k = apply_rotary_pos_emb(
            qn.float().transpose(0, 1)[None], kn.float().transpose(0, 1)[None], cos[None], sin[None]
        )
    want_q, want_k = want_q[0].transpose(0, 1).to(dtype), want_k[0].transpose(0, 1).to(dtype)
    k_pool = torch.zeros(2 * T, hkv, D, device="cuda", dtype=dtype)
    q_rot, k_rot, _, _ = attnprep.rope_pool_fused(
        q,
        k,
        v,
        positions,
        torch.arange(T, device="cuda"),
        k_pool,
        torch.zeros_like(k_pool),
        head_dim=D,
        num_qo_heads=hq,
        num_kv_heads=hkv,
        rope_base=1e6,
        cos_sin_cache=cache,
        q_norm_weight=q_norm.weight.detach(),  # a parameter: it requires grad (the op refuses that)
        k_norm_weight=k_norm.weight.detach(),
        norm_eps=1e-6,
        norm_weight_offset=offset,
    )
    for got, want, n in ((q_rot, want_q, qn), (k_rot, want_k, kn)):
        assert model_error_ratio(got, want, n) <= 1.0
        if dtype != torch.float32:
            assert (got == want).float().mean().item() > 0.9
