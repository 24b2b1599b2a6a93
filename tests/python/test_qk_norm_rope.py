"""qk_norm_rope: the QK norm (per head, or per token across all heads) and
RoPE with no KV cache, [T, H, D] or [B, S, H, D]. On the GPU: bit for bit
rope_pool_fused's q_rot and k_rot (the pool-free kernel computes what the
pool-writing one does), the per-token norm bit for bit its reference, every
batched layout (slices of a fused projection, a transposed [B, H, S, D], rows
shared by the batch, in place), and diffusers' own norm + RoPE of Flux,
HunyuanVideo, Qwen-Image and Wan 2.1. On the CPU: every message."""

import attnprep
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def fake(*shapes, dtype=torch.float32):
    return [torch.empty(s, device="cuda", dtype=dtype) for s in shapes]


def test_shapes_are_checked_first():
    with FakeTensorMode():
        q, k, rows = fake((2, 5, 4, 64), (2, 5, 2, 64), (5, 64))
        q_rot, k_rot = attnprep.qk_norm_rope(q, k, cos_sin_cache=rows)
        assert q_rot.shape == (2, 5, 4, 64) and k_rot.shape == (2, 5, 2, 64)
        q2, k3, k_short = fake((4, 64), (5, 2, 64), (2, 4, 2, 64))
        cases = [
            ((q2, k3), {}, "qk_norm_rope expects q and k of [T, heads, head_dim] or [B, S, heads, head_dim], "),
            ((q, k3), {}, "qk_norm_rope expects q and k of [T, heads, head_dim] or [B, S, heads, head_dim], "),
            ((q, k_short), {}, "qk_norm_rope expects q and k with the same leading dimensions, "),
        ]
        for args, kw, start in cases:
            with pytest.raises(ValueError) as e:
                attnprep.qk_norm_rope(*args, **kw)
            assert str(e.value) == start + f"got {args[0].shape} and {args[1].shape}"
        (pos,) = fake((5,), dtype=torch.long)
        with pytest.raises(ValueError) as e:
            attnprep.qk_norm_rope(q, k, pos)
        assert str(e.value) == "qk_norm_rope expects positions of shape [2, 5], got torch.Size([5])"
        (pos,) = fake((2, 5), dtype=torch.long)
        with pytest.raises(ValueError) as e:
            attnprep.qk_norm_rope(q, k, pos, mrope_section=[8, 12, 12])
        assert str(e.value) == "qk_norm_rope expects positions of shape [3, 2, 5], got torch.Size([2, 5])"
        # then rope_pool_fused's checks, on [B * S, heads, head_dim]
        (seven_rows,) = fake((7, 64))
        with pytest.raises(ValueError) as e:
            attnprep.qk_norm_rope(q, k, cos_sin_cache=seven_rows)
        assert str(e.value) == (
            "positions=None needs cos_sin_cache of one row per token, [num_tokens, rotary_dim] = [10, 64]"
        )
    with pytest.raises(TypeError) as e:
        attnprep.qk_norm_rope([1], torch.empty(1))
    assert str(e.value) == "q must be a torch.Tensor, got list"
    with pytest.raises(TypeError) as e:
        attnprep.qk_norm_rope(torch.empty(2, 3, 4), torch.empty(2, 3, 4), [0, 1])
    assert str(e.value) == "positions must be a torch.Tensor, got list"


def test_rope_pool_fused_writes_the_whole_cache_or_none_of_it():
    with FakeTensorMode():
        q, k, v, pool = fake((5, 4, 64), (5, 2, 64), (5, 2, 64), (16, 2, 64))
        (pos,) = fake((5,), dtype=torch.long)
        kw = dict(head_dim=64, num_qo_heads=4, num_kv_heads=2, rope_base=1e4)
        q_rot, k_rot, k_pool, v_pool = attnprep.rope_pool_fused(q, k, None, pos, None, None, None, **kw)
        assert q_rot.shape == q.shape and k_pool is None and v_pool is None
        for v_, slots, k_pool, v_pool in ((None, pos, pool, pool), (v, None, pool, pool), (v, pos, None, pool)):
            with pytest.raises(ValueError) as e:
                attnprep.rope_pool_fused(q, k, v_, pos, slots, k_pool, v_pool, **kw)
            assert str(e.value) == "v, slots, k_pool and v_pool must be given together or all be None"
        (scale,) = fake(())
        with pytest.raises(ValueError) as e:
            attnprep.rope_pool_fused(q, k, None, pos, None, None, None, k_scale=scale, v_scale=scale, **kw)
        assert str(e.value) == "k_scale and v_scale apply to fp8 pools only, got no pools"


def case(shape_q, shape_k, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape_q, device="cuda", dtype=dtype, generator=g),) + (
        torch.randn(shape_k, device="cuda", dtype=dtype, generator=g),
    )


def same_bits(a, b):
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@CUDA
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "qk_norm"])
@pytest.mark.parametrize("T", [1, 17, 1100])
@pytest.mark.parametrize("D", [64, 128, 96])
def test_bit_for_bit_rope_pool_fused(dtype, is_neox, norm, T, D):
    q, k = case((T, 12, D), (T, 4, D), dtype)
    v = torch.randn_like(k)
    positions = torch.randint(0, 4000, (T,), device="cuda")
    kw = dict(rope_base=1e4, is_neox=is_neox, rotary_dim=D if D != 96 else 64)
    if norm:
        kw.update(q_norm_weight=torch.rand(D, device="cuda") + 0.5, k_norm_weight=torch.rand(D, device="cuda") + 0.5)
    pools = [torch.zeros(T, 4, D, device="cuda", dtype=dtype) for _ in range(2)]
    want = attnprep.rope_pool_fused(
        q, k, v, positions, torch.arange(T, device="cuda"), *pools, head_dim=D, num_qo_heads=12, num_kv_heads=4, **kw
    )
    got = attnprep.qk_norm_rope(q, k, positions, **kw)
    same_bits(got[0], want[0])
    same_bits(got[1], want[1])


@CUDA
@pytest.mark.parametrize("layout", ["fused_projection", "transposed", "shared_rows", "inplace", "mrope"])
def test_batched_layouts(layout):
    B, S, H, D = 3, 37, 4, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    table = attnprep.rope_cos_sin_cache(D, 500, 1e4, device="cuda")
    positions = torch.randint(0, 500, (B, S), device="cuda", generator=g)
    w = dict(q_norm_weight=torch.rand(D, device="cuda") + 0.5, k_norm_weight=torch.rand(D, device="cuda") + 0.5)
    if layout in ("fused_projection", "inplace", "mrope"):
        qkv = torch.randn(B, S, 3 * H * D, device="cuda", dtype=torch.bfloat16, generator=g)
        q, k, _ = (t.unflatten(-1, (H, D)) for t in qkv.split(H * D, dim=-1))
    else:  # [B, H, S, D] storage seen as [B, S, H, D]: batch and tokens do not flatten
        q, k = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2) for _ in "qk")
    flat = [x.reshape(B * S, H, D) for x in (q, k)]  # the same values, contiguous tokens
    if layout == "shared_rows":  # S rows, every batch item reading them
        rows = table[positions[0]]
        want = attnprep.qk_norm_rope(*flat, positions[0].repeat(B), cos_sin_cache=table, **w)
        got = attnprep.qk_norm_rope(q, k, cos_sin_cache=rows, **w)
    elif layout == "mrope":
        pos3 = torch.randint(0, 500, (3, B, S), device="cuda", generator=g)
        mk = dict(mrope_section=[16, 24, 24], cos_sin_cache=table)
        want = attnprep.qk_norm_rope(*flat, pos3.reshape(3, B * S), **mk, **w)
        got = attnprep.qk_norm_rope(q, k, pos3, **mk, **w)
    else:
        want = attnprep.qk_norm_rope(*flat, positions.reshape(-1), cos_sin_cache=table, **w)
        got = attnprep.qk_norm_rope(q, k, positions, cos_sin_cache=table, inplace=layout == "inplace", **w)
        if layout == "inplace":
            assert got[0] is q and got[1] is k
    assert got[0].shape == (B, S, H, D) and got[1].shape == (B, S, H, D)
    same_bits(got[0].reshape(B * S, H, D), want[0])
    same_bits(got[1].reshape(B * S, H, D), want[1])


def rms_norm(dim, dtype, seed):
    norm = torch.nn.RMSNorm(dim, eps=1e-6).to("cuda", dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(dim, generator=torch.Generator().manual_seed(seed)))
    return norm


def diffusers_freqs(model, S):
    """The model's own RoPE: (form for its apply function, rows for qk_norm_rope) of S tokens."""
    flux = pytest.importorskip("diffusers.models.transformers.transformer_flux")
    embeddings = pytest.importorskip("diffusers.models.embeddings")
    if model == "flux":  # text ids at 0, image ids on a grid
        ids = torch.zeros(S, 3)
        ids[:, 1], ids[:, 2] = torch.arange(S) // 8, torch.arange(S) % 8
        cos, sin = flux.FluxPosEmbed(theta=10000, axes_dim=[16, 56, 56])(ids.cuda())
        return (cos, sin), attnprep.rope_cos_sin_rows(cos, sin)
    if model == "hunyuan_video":
        hunyuan = pytest.importorskip("diffusers.models.transformers.transformer_hunyuan_video")
        rope = hunyuan.HunyuanVideoRotaryPosEmbed(patch_size=2, patch_size_t=1, rope_dim=[16, 56, 56], theta=256.0)
        latents = torch.zeros(1, 4, S // 16, 8, 8, device="cuda")  # S // 16 frames of 4 x 4 patches
        cos, sin = rope(latents)
        return (cos, sin), attnprep.rope_cos_sin_rows(cos, sin)
    freqs = embeddings.get_1d_rotary_pos_embed(128, torch.arange(S), theta=10000, use_real=False).cuda()
    return freqs, attnprep.rope_cos_sin_rows(freqs)


@CUDA
@pytest.mark.parametrize("model", ["flux", "hunyuan_video", "qwen_image"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_diffusers_norm_and_rope(model, dtype):
    """q and k of a fused projection, [B, S, heads, 128], through diffusers' own per-head RMSNorm modules and
    rotary function, and through qk_norm_rope with their weights (HunyuanVideo: the image tokens before the text
    ones, a view whose batch and tokens do not flatten)."""
    qwen = pytest.importorskip("diffusers.models.transformers.transformer_qwenimage")
    embeddings = pytest.importorskip("diffusers.models.embeddings")
    B, S, H, D, text = 2, 64, 3, 128, 7
    form, rows = diffusers_freqs(model, S)
    g = torch.Generator(device="cuda").manual_seed(4)
    qkv = torch.randn(B, S + text, 3 * H * D, device="cuda", dtype=dtype, generator=g)
    q, k, _ = (t.unflatten(-1, (H, D))[:, :S] for t in qkv.split(H * D, dim=-1))
    norm_q, norm_k = rms_norm(D, dtype, 0), rms_norm(D, dtype, 1)
    with torch.no_grad():
        if model == "qwen_image":
            want = [qwen.apply_rotary_emb_qwen(n(x), form, use_real=False) for n, x in ((norm_q, q), (norm_k, k))]
        else:
            want = [embeddings.apply_rotary_emb(n(x), form, sequence_dim=1) for n, x in ((norm_q, q), (norm_k, k))]
    with torch.no_grad():  # inference only: the modules' weights require grad
        got = attnprep.qk_norm_rope(
            q, k, cos_sin_cache=rows, is_neox=False, q_norm_weight=norm_q.weight, k_norm_weight=norm_k.weight
        )
    # float32: a few ulp (sum order, rsqrt); bf16: the norm's output rounds where torch's RMSNorm does not
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    for a, b in zip(got, want):
        assert ((a.double() - b.double()).abs().max() / b.double().abs().max()).item() <= tol


def test_the_per_token_norm_is_a_weight_of_heads_times_head_dim():
    with FakeTensorMode():
        q, k, rows, w = fake((2, 5, 4, 64), (2, 5, 4, 64), (5, 64), (256,))
        q_rot, k_rot = attnprep.qk_norm_rope(q, k, cos_sin_cache=rows, q_norm_weight=w, k_norm_weight=w)
        assert q_rot.shape == q.shape and k_rot.shape == k.shape
        (half,) = fake((256,), dtype=torch.float16)
        with pytest.raises(ValueError) as e:
            attnprep.qk_norm_rope(q, k, cos_sin_cache=rows, q_norm_weight=half)
        assert (
            str(e.value)
            == "q_norm_weight and k_norm_weight must be float32 or q's dtype (torch.float32), got torch.float16"
        )
        (odd,) = fake((255,))  # neither [head_dim] nor [heads * head_dim]: rope_pool_fused's check 34
        with pytest.raises(ValueError) as e:
            attnprep.qk_norm_rope(q, k, cos_sin_cache=rows, k_norm_weight=odd)
        assert (
            str(e.value) == "q_norm_weight and k_norm_weight must have shape [head_dim] = [64], got torch.Size([255])"
        )


def token_norm_reference(x, w, eps=1e-6, offset=0.0):
    """The per-token norm: attnprep.testing's norm over each token's heads * head_dim elements."""
    from attnprep.testing import rms_norm_reference

    return rms_norm_reference(x.reshape(x.shape[0], -1), w, eps, offset).reshape(x.shape).to(x.device)


@CUDA
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("heads, D", [(12, 128), (5, 64), (3, 96), (40, 128)])
@pytest.mark.parametrize("T", [1, 17, 300])
def test_per_token_norm_bit_for_bit(dtype, offset, heads, D, T):
    """The norm is its reference's to the bit; then the rotation as without a norm (k per head, q per token)."""
    q, k = case((T, heads, D), (T, heads, D), dtype, seed=T + heads)
    wq = (1 + 0.2 * torch.randn(heads * D, device="cuda")).to(dtype if offset else torch.float32)
    wk = torch.rand(D, device="cuda") + 0.5
    positions = torch.randint(0, 3000, (T,), device="cuda")
    kw = dict(rope_base=1e4, norm_eps=1e-5, norm_weight_offset=offset)
    got = attnprep.qk_norm_rope(q, k, positions, q_norm_weight=wq, k_norm_weight=wk, **kw)
    y = token_norm_reference(q, wq, 1e-5, offset)
    want_q = attnprep.qk_norm_rope(y, k, positions, **kw)[0]
    want_k = attnprep.qk_norm_rope(q, k, positions, k_norm_weight=wk, **kw)[1]
    same_bits(got[0], want_q)
    same_bits(got[1], want_k)
    q_in, k_in = q.clone(), k.clone()  # in place: the same values, into q and k
    out = attnprep.qk_norm_rope(q_in, k_in, positions, q_norm_weight=wq, k_norm_weight=wk, inplace=True, **kw)
    assert out[0] is q_in and out[1] is k_in
    same_bits(q_in, got[0])
    same_bits(k_in, got[1])


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_diffusers_wan(dtype, monkeypatch):
    """Wan 2.1's attention module itself (its RMSNorm over heads * head_dim, its RoPE), q and k taken where it
    hands them to attention, against qk_norm_rope on its projections with its weights and WanRotaryPosEmbed's rows."""
    wan = pytest.importorskip("diffusers.models.transformers.transformer_wan")
    B, H, D = 2, 12, 128
    torch.manual_seed(0)
    attn = wan.WanAttention(dim=H * D, heads=H, dim_head=D, eps=1e-6, processor=wan.WanAttnProcessor())
    attn = attn.to("cuda", dtype).eval()
    with torch.no_grad():
        attn.norm_q.weight.copy_(1 + 0.2 * torch.randn(H * D))
        attn.norm_k.weight.copy_(1 + 0.2 * torch.randn(H * D))
    rope = wan.WanRotaryPosEmbed(D, (1, 2, 2), 1024)
    cos, sin = rope(torch.zeros(1, 16, 3, 8, 8))  # S = 3 x 4 x 4
    S = cos.shape[1]
    x = torch.randn(B, S, H * D, device="cuda", dtype=dtype)
    seen = {}

    def capture(query, key, value, **kw):
        seen.update(q=query, k=key)
        return torch.zeros_like(query)

    monkeypatch.setattr(wan, "dispatch_attention_fn", capture)
    with torch.no_grad():
        attn(x, rotary_emb=(cos.cuda(), sin.cuda()))
        q, k = (proj(x).unflatten(-1, (H, D)) for proj in (attn.to_q, attn.to_k))
        rows = attnprep.rope_cos_sin_rows(cos[0, :, 0], sin[0, :, 0]).cuda()
        got = attnprep.qk_norm_rope(
            q, k, cos_sin_cache=rows, is_neox=False, q_norm_weight=attn.norm_q.weight, k_norm_weight=attn.norm_k.weight
        )
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    for a, b in zip(got, (seen["q"], seen["k"])):
        assert a.shape == b.shape
        assert ((a.double() - b.double()).abs().max() / b.double().abs().max()).item() <= tol
