"""mla_rope_pool_fused: on the GPU against attnprep.testing.mla_reference (float64 rotation, the kv_c norm bit for
bit) over odd sizes, strided slices of one projection output, combined, separate, paged and fp8 caches, NeoX and
GPT-J, YaRN tables, in place, fp8 q, out-of-table positions, CUDA graphs, torch.compile and opcheck; on the CPU,
every message on fake tensors, in order."""

import attnprep
import pytest
import torch
from attnprep.testing import mla_reference, quantize_reference, rope_error_ratio
from conftest import capture, same_bits
from rope_schemes import SCHEMES
from torch._subclasses.fake_tensor import FakeTensorMode

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
E4M3 = torch.float8_e4m3fn


def fake_call(T=4, H=16, L=512, R=64, q_dim=192, cache=(8, 64, 576), cache_dtype=None, **kw):
    with FakeTensorMode():
        q = torch.empty(T, H, q_dim, device="cuda", dtype=torch.bfloat16)
        kv_c, k_pe = (torch.empty(T, n, device="cuda", dtype=torch.bfloat16) for n in (L, R))
        positions, slots = (torch.zeros(T, dtype=torch.long, device="cuda") for _ in range(2))
        kv_cache = torch.empty(cache, device="cuda", dtype=cache_dtype or torch.bfloat16)
        kw = {k: (v() if callable(v) else v) for k, v in kw.items()}  # tensors made inside the mode
        return attnprep.mla_rope_pool_fused(q, kv_c, k_pe, positions, slots, kv_cache, **kw)


def f32(*shape):
    return lambda: torch.ones(shape, device="cuda")


def test_the_fake_kernel_gives_the_outputs():
    q_rot, k_pe_rot, _, kpe = fake_call()
    assert q_rot.shape == (4, 16, 192) and q_rot.dtype == torch.bfloat16 and k_pe_rot.shape == (4, 64) and kpe is None
    q8, _, _, _ = fake_call(q_scale=f32())
    assert q8.dtype == E4M3


def test_messages_in_order():
    cases = [
        (dict(q_dim=32), "q.shape[2] must be at least k_pe.shape[1] = 64, got 32"),
        (
            dict(T=4, cache=(8, 64, 512)),
            "kv_cache must have shape [slots, 576] or [pages, page_size, 576], got torch.Size([8, 64, 512])",
        ),
        (
            dict(cache_dtype=torch.float16),
            "cache dtypes must be q's dtype, float8_e4m3fn or float8_e5m2 (both caches alike)",
        ),
        (
            dict(R=63, cache=(8, 64, 575)),
            "mla_rope_pool_fused expects an even rope dimension (k_pe.shape[1]) in [2, 512], got 63",
        ),
        (
            dict(L=4096, cache=(8, 64, 4160)),
            "mla_rope_pool_fused expects kv_lora_rank (kv_c.shape[1]) in [1, 2048], got 4096",
        ),
        (
            dict(cos_sin_cache=f32(100, 128)),
            "cos_sin_cache must have shape [max_position, rotary_dim] = [*, 64], got torch.Size([100, 128])",
        ),
        (dict(rope_base=-1.0), "rope_base must be a positive number"),
        (dict(kv_norm_weight=f32(576)), "kv_norm_weight must have shape [kv_lora_rank] = [512], got torch.Size([576])"),
        (dict(norm_eps=0.0), "norm_eps must be a positive finite number, got 0"),
        (dict(cache_dtype=E4M3), "fp8 caches need cache_scale"),
        (dict(cache_scale=f32()), "cache_scale applies to fp8 caches only, got torch.bfloat16 caches"),
        (dict(q_scale=f32(2)), "cache_scale and q_scale must have shape [] or [1], got torch.Size([2])"),
        (dict(q_scale=f32(), inplace=True), "q_scale needs inplace=False: q_rot is float8_e4m3fn"),
        # earlier checks first: 20 before 27, 24 before 28
        (dict(rope_base=0.0, norm_eps=0.0), "rope_base must be a positive number"),
        (
            dict(kv_norm_weight=f32(3), cache_dtype=E4M3),
            "kv_norm_weight must have shape [kv_lora_rank] = [512], got torch.Size([3])",
        ),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError) as e:
            fake_call(**kw)
        assert str(e.value) == message, kw


def test_cpu_tensors_and_argument_types():
    q, kv_c, k_pe = torch.randn(2, 4, 96), torch.randn(2, 100), torch.randn(2, 32)
    idx, cache = torch.arange(2), torch.zeros(4, 132)
    with pytest.raises(ValueError) as e:
        attnprep.mla_rope_pool_fused(q, kv_c, k_pe, idx, idx, cache)
    assert str(e.value) == "mla_rope_pool_fused expects CUDA or MPS tensors"
    with pytest.raises(TypeError) as e:
        attnprep.mla_rope_pool_fused(q, kv_c, k_pe, idx, [0, 1], cache)
    assert str(e.value) == "slots must be a torch.Tensor, got list"
    with pytest.raises(TypeError) as e:
        attnprep.mla_rope_pool_fused(q.tolist(), kv_c, k_pe, idx, idx, cache)
    assert str(e.value) == "q must be a torch.Tensor, got list"
    with pytest.raises(TypeError) as e:
        attnprep.mla_rope_pool_fused(q, kv_c, k_pe, idx, idx, cache, is_neox=1)
    assert str(e.value) == "mla_rope_pool_fused: is_neox must be a bool, got int"


def projection(T, H, nope, R, L, dtype, seed=0):
    """q and the kv projection's output [T, L + R] as the model makes them; kv_c and k_pe are its slices."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, H, nope + R, device="cuda", generator=g).to(dtype)
    kv = (4 * torch.randn(T, L + R + 8, device="cuda", generator=g)).to(dtype)[:, 8:]  # rows of stride L + R + 8
    return q, kv[:, :L], kv[:, L:]


def cache_rows(cache, slots, page):
    """The cache rows of ``slots`` ([T, width]) of a [slots, width] or [pages, page, width] cache."""
    return cache[slots] if cache.dim() == 2 else cache[slots // page, slots % page]


def check(q, kv_c, k_pe, positions, slots, kv_cache, kpe_cache=None, page=1, **kw):
    """One call against mla_reference; returns the outputs."""
    before = [c.clone() for c in (kv_cache, kpe_cache) if c is not None]
    q_in, pe_in = q.clone(), k_pe.clone()
    out = attnprep.mla_rope_pool_fused(q, kv_c, k_pe, positions, slots, kv_cache, kpe_cache=kpe_cache, **kw)
    q_rot, k_pe_rot = out[0], out[1]
    ref_kw = {k: kw[k] for k in ("rope_base", "is_neox", "cos_sin_cache", "kv_norm_weight", "norm_eps") if k in kw}
    want_q, want_pe, latent = mla_reference(q_in, kv_c, pe_in, positions, **ref_kw)
    R = k_pe.shape[1]
    is_neox = kw.get("is_neox", False)
    if kw.get("q_scale") is None:
        assert rope_error_ratio(q_rot[..., -R:], want_q[..., -R:], q_in[..., -R:], R, is_neox) <= 1
        assert torch.equal(q_rot[..., :-R].cpu(), q_in[..., :-R].cpu())
    assert rope_error_ratio(k_pe_rot[:, None], want_pe[:, None], pe_in[:, None], R, is_neox) <= 1
    ok = slots >= 0
    rows = slots[ok]
    kv_part = cache_rows(kv_cache, rows, page)
    pe_part = cache_rows(kpe_cache, rows, page) if kpe_cache is not None else kv_part[:, kv_c.shape[1] :]
    kv_part = kv_part[:, : kv_c.shape[1]]
    scale = kw.get("cache_scale")
    if scale is None:
        assert same_bits(kv_part.cpu(), latent[ok.cpu()]) and same_bits(pe_part, k_pe_rot[ok])
    else:
        assert same_bits(kv_part.cpu(), quantize_reference(latent[ok.cpu()], scale.cpu(), kv_cache.dtype))
        assert same_bits(pe_part, quantize_reference(k_pe_rot[ok], scale, kv_cache.dtype))
    # rows no token names are untouched
    written = torch.zeros(before[0].shape[0] * (page if before[0].dim() == 3 else 1), dtype=torch.bool)
    written[rows.cpu()] = True
    for b, c in zip(before, [c for c in (kv_cache, kpe_cache) if c is not None]):
        flat_b, flat_c = b.reshape(written.shape[0], -1), c.reshape(written.shape[0], -1)
        assert same_bits(flat_c[~written.to(c.device)], flat_b[~written.to(c.device)])
    return out


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("geometry", ["deepseek", "odd", "one_head", "128_heads", "latent_2048", "latent_1000"])
@pytest.mark.parametrize("cache", ["combined_paged", "combined_flat", "separate_paged", "fp8_paged"])
@pytest.mark.parametrize("is_neox", [False, True], ids=["gptj", "neox"])
@pytest.mark.parametrize("T", [1, 17, 1100])
def test_against_the_reference(dtype, geometry, cache, is_neox, T):
    H, nope, R, L = {
        "deepseek": (16, 128, 64, 512),
        "odd": (3, 40, 32, 100),
        "one_head": (1, 0, 64, 512),
        "latent_2048": (4, 64, 64, 2048),  # kv_c read in chunks on CUDA (lanes hold 16 elements at once)
        "latent_1000": (5, 16, 32, 1000),
    }.get(geometry, (128, 128, 64, 512))
    if geometry == "128_heads" and T == 1100:
        T = 65
    q, kv_c, k_pe = projection(T, H, nope, R, L, dtype, seed=T)
    page = 16 if "paged" in cache else 1
    n_slots = -(-(2 * T + 16) // page) * page  # whole pages
    cache_dtype = E4M3 if cache.startswith("fp8") else dtype
    shape = (n_slots // page, page) if page > 1 else (n_slots,)
    kw = dict(is_neox=is_neox, kv_norm_weight=torch.rand(L, device="cuda") + 0.5)
    if cache.startswith("separate"):
        kv_cache = torch.full((*shape, L), float("nan"), device="cuda").to(cache_dtype)
        kw["kpe_cache"] = torch.full((*shape, R), float("nan"), device="cuda").to(cache_dtype)
    else:
        kv_cache = torch.full((*shape, L + R), float("nan"), device="cuda").to(cache_dtype)
    if cache_dtype == E4M3:
        kw["cache_scale"] = torch.tensor(0.75, device="cuda")
    positions = torch.randint(0, 1 << 16, (T,), device="cuda")
    slots = torch.randperm(n_slots, device="cuda")[:T]
    slots[1::5] = -1
    check(q, kv_c, k_pe, positions, slots, kv_cache, page=page, **kw)


@CUDA
def test_yarn_table_strided_indices_unnormalized_kv_and_in_place():
    """DeepSeek-V3's YaRN table (bf16 and float32), int32 indices with strides, no norm, then the same in place."""
    T, H, L, R = 33, 16, 512, 64
    q, kv_c, k_pe = projection(T, H, 128, R, L, torch.bfloat16, seed=3)
    base, scaling, _ = SCHEMES["yarn_mscale"]
    for table_dtype in (torch.float32, torch.bfloat16):
        table = attnprep.rope_cos_sin_cache(R, 8192, base, scaling=scaling, dtype=table_dtype, device="cuda")
        ids = torch.randint(0, 8192, (T, 3), device="cuda", dtype=torch.int32)
        slot_buf = torch.randperm(2 * T, device="cuda").to(torch.int32)
        cache = torch.zeros(4, 32, L + R, device="cuda", dtype=torch.bfloat16)
        kw = dict(cos_sin_cache=table)
        check(q, kv_c, k_pe, ids[:, 1], slot_buf[::2], cache, page=32, **kw)
        q_ip, pe_ip = q.clone(), k_pe.clone()
        out = attnprep.mla_rope_pool_fused(q_ip, kv_c, pe_ip, ids[:, 1], slot_buf[::2], cache, inplace=True, **kw)
        assert out[0] is q_ip and out[1] is pe_ip
        want = attnprep.mla_rope_pool_fused(q, kv_c, k_pe, ids[:, 1], slot_buf[::2], cache.clone(), **kw)
        assert same_bits(q_ip, want[0]) and same_bits(pe_ip, want[1])


@CUDA
def test_fp8_q_out_of_table_positions_and_graphs():
    T, L, R = 9, 512, 64
    q, kv_c, k_pe = projection(T, 16, 128, R, L, torch.bfloat16, seed=5)
    table = attnprep.rope_cos_sin_cache(R, 100, 1e4, device="cuda")
    positions = torch.randint(0, 100, (T,), device="cuda")
    positions[4] = 100  # outside the table: NaN rows, no cache write
    slots = torch.arange(T, device="cuda")
    cache = torch.zeros(T, L + R, device="cuda", dtype=torch.bfloat16)
    q_scale = torch.tensor(0.5, device="cuda")
    q_rot, pe_rot, _, _ = attnprep.mla_rope_pool_fused(q, kv_c, k_pe, positions, slots, cache, cos_sin_cache=table)
    assert q_rot[4, :, -R:].isnan().all() and pe_rot[4].isnan().all() and (cache[4] == 0).all()
    assert not q_rot[4, :, :-R].isnan().any()
    call = lambda: attnprep.mla_rope_pool_fused(  # noqa: E731
        q, kv_c, k_pe, positions, slots, cache, cos_sin_cache=table, q_scale=q_scale
    )
    graph, (q8, _, _, _) = capture(call)
    q_scale.fill_(0.125)
    graph.replay()
    torch.cuda.synchronize()
    assert q8.dtype == E4M3 and same_bits(q8, quantize_reference(q_rot, q_scale, E4M3))


@CUDA
def test_torch_compile_and_opcheck():
    T, L, R = 17, 512, 64
    q, kv_c, k_pe = projection(T, 16, 128, R, L, torch.bfloat16, seed=7)
    positions, slots = torch.randint(0, 500, (T,), device="cuda"), torch.randperm(64, device="cuda")[:T]
    w = torch.rand(L, device="cuda") + 0.5

    def f(q, kv_c, k_pe, cache):
        q_rot, pe_rot, _, _ = attnprep.mla_rope_pool_fused(q, kv_c, k_pe, positions, slots, cache, kv_norm_weight=w)
        return q_rot, pe_rot

    caches = [torch.zeros(64, L + R, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    want = f(q, kv_c, k_pe, caches[0])
    got = torch.compile(f, fullgraph=True)(q, kv_c, k_pe, caches[1])
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1]) and same_bits(caches[1], caches[0])
    args = (q, kv_c.contiguous(), k_pe.contiguous(), positions, slots, caches[0], 1e4, False, None, w, 1e-6, None)
    torch.library.opcheck(torch.ops.attnprep.mla_rope_pool_fused.default, (*args, None, None, False))
