"""rope_pool_fused into the KV caches servers run: paged pools (NHD, HND),
views of one combined buffer, fp8 pools with scales on the device; against
attnprep.testing's plain-torch pool reference, bit for bit."""

import attnprep
import pytest
import torch
from attnprep.testing import cos_sin, pool_write_reference, rope_error_ratio, rope_reference
from conftest import capture, poison_like, requires_cuda, same_bits
from torch._subclasses.fake_tensor import FakeTensorMode

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def pools(layout, page_size, slots_total, heads, dim, dtype, combined=False):
    """k and v pools of `slots_total` slots, poisoned, as the layout shapes them."""
    pages = slots_total // page_size
    if layout == "flat":
        shape = (slots_total, heads, dim)
    elif layout == "NHD":
        shape = (pages, page_size, heads, dim)
    else:
        shape = (pages, heads, page_size, dim)
    if combined:  # one [pages, 2, ...] buffer, k and v its halves
        buf = poison_like((shape[0], 2) + shape[1:], dtype, "cuda")
        return buf[:, 0], buf[:, 1]
    return poison_like(shape, dtype, "cuda"), poison_like(shape, dtype, "cuda")


def run(
    layout="NHD",
    page_size=16,
    dtype=torch.bfloat16,
    pool_dtype=None,
    T=65,
    hq=8,
    hkv=2,
    dim=128,
    per_head_scale=False,
    combined=False,
    inplace=False,
    seed=0,
    cache=None,
):
    g = torch.Generator().manual_seed(seed)
    pool_dtype = pool_dtype or dtype
    # whole pages, at least eight, about twice the tokens
    slots_total = page_size * max(8, -(-2 * T // page_size)) if layout != "flat" else 4 * T
    q = torch.randn(T, hq, dim, generator=g).to(dtype).cuda()
    k = torch.randn(T, hkv, dim, generator=g).to(dtype).cuda()
    v = (4 * torch.randn(T, hkv, dim, generator=g)).to(dtype).cuda()
    positions = torch.randint(0, 1 << 16, (T,), generator=g).cuda()
    # distinct slots (two tokens on one slot would race), the last slot of
    # every page among the first ones
    order = torch.randperm(slots_total, generator=g)
    if layout != "flat":
        ends = torch.arange(slots_total // page_size) * page_size + page_size - 1
        order = torch.cat([ends, order[~torch.isin(order, ends)]])
    slots = order[:T].cuda()
    assert slots.unique().numel() == T
    slots[1::7] = -1
    slots[3::11] = slots_total + 5  # past the pool: never written
    k_pool, v_pool = pools(layout, page_size, slots_total, hkv, dim, pool_dtype, combined)
    scales = {}
    if pool_dtype in FP8:
        n = hkv if per_head_scale else 1
        scales = dict(
            k_scale=(0.5 + torch.rand(n, generator=g)).cuda().reshape(() if n == 1 and not per_head_scale else (n,)),
            v_scale=(0.5 + torch.rand(n, generator=g)).cuda(),
        )
    kp_before, vp_before = k_pool.clone(), v_pool.clone()
    q_in, k_in = q.clone(), k.clone()
    q_rot, k_rot, kp, vp = attnprep.rope_pool_fused(
        q,
        k,
        v,
        positions,
        slots,
        k_pool,
        v_pool,
        head_dim=dim,
        num_qo_heads=hq,
        num_kv_heads=hkv,
        rope_base=10000.0,
        kv_layout="NHD" if layout == "flat" else layout,
        inplace=inplace,
        cos_sin_cache=cache,
        **scales,
    )
    assert kp is k_pool and vp is v_pool
    cos, sin = cos_sin(positions, dim, 10000.0, cache)
    assert rope_error_ratio(q_rot, rope_reference(q_in, cos, sin, dim, True), q_in, dim, True) <= 1
    assert rope_error_ratio(k_rot, rope_reference(k_in, cos, sin, dim, True), k_in, dim, True) <= 1
    assert k_rot.dtype == dtype  # returned unquantized
    lay = "NHD" if layout == "flat" else layout
    want_k = pool_write_reference(kp_before, k_rot, slots, lay, scales.get("k_scale"))
    want_v = pool_write_reference(vp_before, v, slots, lay, scales.get("v_scale"))
    assert same_bits(k_pool, want_k) and same_bits(v_pool, want_v)
    return slots, k_pool


@requires_cuda
@pytest.mark.parametrize("pool_dtype", [None] + FP8, ids=["same", "e4m3", "e5m2"])
@pytest.mark.parametrize("layout, page_size", [("flat", 1), ("NHD", 16), ("NHD", 64), ("HND", 16), ("HND", 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_layouts_and_pool_dtypes(dtype, layout, page_size, pool_dtype):
    run(layout, page_size, dtype, pool_dtype, seed=page_size)


@requires_cuda
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16] + FP8, ids=str)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("T", [1, 17, 1100])
def test_combined_buffer_views_and_sizes(T, layout, pool_dtype):
    run(layout, 16, torch.bfloat16, pool_dtype, T=T, combined=True, seed=T)


@requires_cuda
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16] + FP8, ids=str)
@pytest.mark.parametrize("T", [17, 1100])
def test_pages_and_fp8_with_cos_sin_cache(T, pool_dtype, cache_dtype):
    cache = attnprep.rope_cos_sin_cache(128, 1 << 16, 1e6, dtype=cache_dtype, device="cuda")
    run("HND", 16, torch.bfloat16, pool_dtype, T=T, hq=32, hkv=8, combined=True, seed=T, cache=cache)


@requires_cuda
@pytest.mark.parametrize("pool_dtype", FP8, ids=str)
def test_per_head_scales_and_saturation(pool_dtype):
    run("NHD", 16, torch.bfloat16, pool_dtype, per_head_scale=True, seed=3)
    # values far past the format's range (both formats) saturate to its largest finite value
    T, dim = 4, 64
    k = torch.full((T, 1, dim), 1e6, device="cuda")
    k_pool = torch.zeros(1, 4, 1, dim, device="cuda").to(pool_dtype)
    v_pool = torch.zeros_like(k_pool)
    attnprep.rope_pool_fused(
        torch.zeros(T, 1, dim, device="cuda"),
        k,
        -k,
        torch.zeros(T, dtype=torch.long, device="cuda"),
        torch.arange(T, device="cuda"),
        k_pool,
        v_pool,
        head_dim=dim,
        num_qo_heads=1,
        num_kv_heads=1,
        rope_base=1e4,
        k_scale=torch.tensor(1e-3, device="cuda"),
        v_scale=torch.ones(1, device="cuda"),
    )
    # inside the range, the nearest value: 1e4 is 10240 in e5m2 (spacing 2048 there)
    fmax = torch.finfo(pool_dtype).max
    assert (k_pool.float() == fmax).all() and (v_pool.float() == -fmax).all()


@requires_cuda
@pytest.mark.parametrize("pool_dtype", FP8, ids=str)
def test_scales_where_the_kernel_divides_and_at_the_reciprocal_paths_edges(pool_dtype):
    """The kernel divides by scales outside [2^-64, 2^64] (and negative ones)
    and multiplies by a corrected reciprocal inside (core/fp8_quotient.h):
    per-head scales on both sides of those edges, values from 2^-120 to 2^120
    in magnitude, bit for bit against the IEEE quotient's fp8 rounding."""
    g = torch.Generator().manual_seed(11)
    T, hkv, dim = 33, 8, 64
    scales = torch.tensor([2.0**-64, 2.0**64, 1e-40, 2.0**70, -2.0, 3.0, 0.1, 1.5 * 2.0**-63]).cuda()
    magnitude = 2.0 ** torch.randint(-120, 121, (T, hkv, dim), generator=g).float()
    v = (torch.randn(T, hkv, dim, generator=g) * magnitude).to(torch.bfloat16).cuda()
    k = torch.randn(T, hkv, dim, generator=g).to(torch.bfloat16).cuda() * 2.0**40
    slots = torch.randperm(4 * 16, generator=g)[:T].cuda()
    k_pool, v_pool = pools("NHD", 16, 4 * 16, hkv, dim, pool_dtype)
    kp_before, vp_before = k_pool.clone(), v_pool.clone()
    q = torch.randn(T, 1, dim, generator=g).to(torch.bfloat16).cuda()
    _, k_rot, _, _ = attnprep.rope_pool_fused(
        q,
        k,
        v,
        torch.arange(T, device="cuda"),
        slots,
        k_pool,
        v_pool,
        head_dim=dim,
        num_qo_heads=1,
        num_kv_heads=hkv,
        rope_base=1e4,
        k_scale=scales,
        v_scale=scales,
    )
    assert same_bits(k_pool, pool_write_reference(kp_before, k_rot, slots, "NHD", scales))
    assert same_bits(v_pool, pool_write_reference(vp_before, v, slots, "NHD", scales))


@requires_cuda
def test_inplace_and_gptj_with_paged_fp8():
    run("HND", 16, torch.bfloat16, torch.float8_e4m3fn, inplace=True, seed=5)


@requires_cuda
def test_scales_are_read_on_the_device_in_graphs():
    """A server updates the scales between replays; the captured call reads the new ones."""
    T, hkv, dim = 9, 2, 64
    q, k, v = (torch.randn(T, h, dim, device="cuda", dtype=torch.bfloat16) for h in (4, hkv, hkv))
    positions, slots = torch.arange(T, device="cuda"), torch.arange(T, device="cuda")
    k_pool = torch.zeros(2, 16, hkv, dim, device="cuda", dtype=torch.float8_e4m3fn)
    v_pool = torch.zeros_like(k_pool)
    k_scale, v_scale = torch.ones((), device="cuda"), torch.ones((), device="cuda")
    kw = dict(head_dim=dim, num_qo_heads=4, num_kv_heads=hkv, rope_base=1e4, k_scale=k_scale, v_scale=v_scale)
    call = lambda: attnprep.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, **kw)  # noqa: E731
    graph, _ = capture(call)
    v_scale.fill_(0.25)
    graph.replay()
    torch.cuda.synchronize()
    assert same_bits(v_pool, pool_write_reference(torch.zeros_like(v_pool), v, slots, "NHD", v_scale))


@requires_cuda
def test_check_slots_counts_the_pages():
    k_pool = torch.zeros(2, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
    args = (
        torch.randn(3, 4, 64, device="cuda", dtype=torch.bfloat16),
        torch.randn(3, 2, 64, device="cuda", dtype=torch.bfloat16),
        torch.randn(3, 2, 64, device="cuda", dtype=torch.bfloat16),
        torch.arange(3, device="cuda"),
    )
    kw = dict(head_dim=64, num_qo_heads=4, num_kv_heads=2, rope_base=1e4, check_slots=True)
    attnprep.rope_pool_fused(*args, torch.tensor([0, 16, 31], device="cuda"), k_pool, torch.zeros_like(k_pool), **kw)
    with pytest.raises(ValueError) as e:
        attnprep.rope_pool_fused(*args, torch.tensor([0, 32, 1], device="cuda"), k_pool, torch.zeros_like(k_pool), **kw)
    assert str(e.value) == "slots must be < pool_size"


@requires_cuda
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "qk_norm"])
@pytest.mark.parametrize("T", [17, 1100])
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16] + FP8, ids=str)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_pools_of_empty_pages(layout, pool_dtype, T, norm):
    """Pages of no slots (page_size 0, a pool of no slots): q and k rotate as
    with any pool and nothing is written; the slot -> page divisor is never
    formed from the 0."""
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(T, h, 128, generator=g).to(torch.bfloat16).cuda() for h in (8, 2, 2))
    positions = torch.randint(0, 1 << 16, (T,), generator=g).cuda()
    slots = torch.arange(T, device="cuda")
    kw = dict(head_dim=128, num_qo_heads=8, num_kv_heads=2, rope_base=1e4, kv_layout=layout)
    if pool_dtype in FP8:
        kw.update(k_scale=torch.ones((), device="cuda"), v_scale=torch.ones((), device="cuda"))
    if norm:
        kw.update(q_norm_weight=torch.rand(128, generator=g).cuda(), k_norm_weight=torch.rand(128, generator=g).cuda())
    shape = (3, 0, 2, 128) if layout == "NHD" else (3, 2, 0, 128)
    empty = [torch.empty(shape, device="cuda", dtype=pool_dtype) for _ in range(2)]
    got = attnprep.rope_pool_fused(q, k, v, positions, slots, *empty, **kw)
    # the same tokens into a pool of real pages, every slot skipped: the same q_rot and k_rot
    real_shape = (3, 16, 2, 128) if layout == "NHD" else (3, 2, 16, 128)
    real = [torch.zeros(real_shape, device="cuda", dtype=pool_dtype) for _ in range(2)]
    want = attnprep.rope_pool_fused(q, k, v, positions, torch.full_like(slots, -1), *real, **kw)
    torch.cuda.synchronize()
    assert got[2] is empty[0] and got[3] is empty[1]
    assert same_bits(got[0], want[0]) and same_bits(got[1], want[1])


@requires_cuda
def test_torch_compile_with_paged_fp8():
    def f(q, k, v, positions, slots, k_pool, v_pool, k_scale, v_scale):
        out = attnprep.rope_pool_fused(
            q,
            k,
            v,
            positions,
            slots,
            k_pool,
            v_pool,
            head_dim=64,
            num_qo_heads=4,
            num_kv_heads=2,
            rope_base=1e4,
            k_scale=k_scale,
            v_scale=v_scale,
            kv_layout="HND",
        )
        return out[0] * 2

    T = 5
    args = [
        torch.randn(T, 4, 64, device="cuda", dtype=torch.bfloat16),
        torch.randn(T, 2, 64, device="cuda", dtype=torch.bfloat16),
        torch.randn(T, 2, 64, device="cuda", dtype=torch.bfloat16),
        torch.arange(T, device="cuda"),
        torch.arange(T, device="cuda") * 3,
        torch.zeros(2, 2, 16, 64, device="cuda", dtype=torch.float8_e4m3fn),
        torch.zeros(2, 2, 16, 64, device="cuda", dtype=torch.float8_e4m3fn),
        torch.ones((), device="cuda"),
        torch.ones((), device="cuda"),
    ]
    eager_pools = [t.clone() for t in args[5:7]]
    want = f(*args[:5], *eager_pools, *args[7:])
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(*args)
    assert torch.equal(got, want)
    assert same_bits(args[5], eager_pools[0]) and same_bits(args[6], eager_pools[1])


# ---------------------------------------------------------------- messages (fake CUDA tensors: no GPU needed)


def fake_call(**over):
    with FakeTensorMode():
        a = dict(
            q=torch.empty(4, 8, 64, device="cuda"),
            k=torch.empty(4, 2, 64, device="cuda"),
            v=torch.empty(4, 2, 64, device="cuda"),
            positions=torch.zeros(4, dtype=torch.long, device="cuda"),
            slots=torch.zeros(4, dtype=torch.long, device="cuda"),
            k_pool=torch.empty(4, 16, 2, 64, device="cuda"),
            v_pool=torch.empty(4, 16, 2, 64, device="cuda"),
        )
        kw = dict(head_dim=64, num_qo_heads=8, num_kv_heads=2, rope_base=1e4)
        for key, val in over.items():
            val = val() if callable(val) else val
            (a if key in a else kw)[key] = val
        return attnprep.rope_pool_fused(*a.values(), **kw)


def fp8_pool(*shape, dtype=torch.float8_e4m3fn):
    return lambda: torch.empty(*shape, device="cuda", dtype=dtype)


def expect(exc, msg, **over):
    with pytest.raises(exc) as e:
        fake_call(**over)
    assert str(e.value) == msg


def test_paged_and_fp8_messages():
    fake_call()  # NHD pages of 16
    fake_call(
        k_pool=fp8_pool(4, 2, 16, 64),
        v_pool=fp8_pool(4, 2, 16, 64),
        kv_layout="HND",
        k_scale=lambda: torch.ones((), device="cuda"),
        v_scale=lambda: torch.ones(2, device="cuda"),
    )
    expect(ValueError, 'kv_layout must be "NHD" or "HND", got nhd', kv_layout="nhd")
    expect(ValueError, "k_pool has incompatible shape torch.Size([4, 16, 2, 64])", kv_layout="HND")
    expect(
        ValueError,
        "v_pool shape must match k_pool shape, got torch.Size([4, 8, 2, 64]) vs torch.Size([4, 16, 2, 64])",
        v_pool=fp8_pool(4, 8, 2, 64, dtype=torch.float32),
    )
    expect(
        ValueError,
        "pool dtypes must match q/k/v dtype",
        k_pool=fp8_pool(4, 16, 2, 64),
        v_pool=fp8_pool(4, 16, 2, 64, dtype=torch.float8_e5m2),
    )
    expect(
        ValueError,
        "fp8 pools need k_scale and v_scale",
        k_pool=fp8_pool(4, 16, 2, 64),
        v_pool=fp8_pool(4, 16, 2, 64),
        k_scale=lambda: torch.ones((), device="cuda"),
    )
    expect(
        ValueError,
        "k_scale and v_scale apply to fp8 pools only, got torch.float32 pools",
        k_scale=lambda: torch.ones((), device="cuda"),
    )
    expect(
        ValueError,
        "k_scale and v_scale must be float32, got torch.bfloat16",
        k_pool=fp8_pool(4, 16, 2, 64),
        v_pool=fp8_pool(4, 16, 2, 64),
        k_scale=lambda: torch.ones((), device="cuda", dtype=torch.bfloat16),
        v_scale=lambda: torch.ones((), device="cuda"),
    )
    expect(
        ValueError,
        "k_scale and v_scale must have shape [], [1] or [num_kv_heads] (contiguous), got torch.Size([1, 2])",
        k_pool=fp8_pool(4, 16, 2, 64),
        v_pool=fp8_pool(4, 16, 2, 64),
        k_scale=lambda: torch.ones(1, 2, device="cuda"),
        v_scale=lambda: torch.ones((), device="cuda"),
    )


def test_slot_count_of_a_huge_empty_pool_is_exact():
    """Check 25's count is pages * page_size exactly, past 64 bits too (an HND pool of no heads)."""
    pool = lambda: torch.empty(1 << 40, 0, 1 << 40, 64, device="cuda")  # noqa: E731
    empty = lambda: torch.empty(4, 0, 64, device="cuda")  # noqa: E731
    expect(
        ValueError,
        f"rope_pool_fused supports paged pools of fewer than 2^32 slots, got {1 << 80}",
        k_pool=pool,
        v_pool=pool,
        kv_layout="HND",
        k=empty,
        v=empty,
        num_kv_heads=0,
    )


def test_argument_types_on_the_direct_path():
    """Arguments are converted before any check (so on a CPU machine too)."""
    a = (
        torch.randn(4, 8, 64),
        torch.randn(4, 2, 64),
        torch.randn(4, 2, 64),
        torch.arange(4),
        torch.arange(4),
        torch.zeros(4, 16, 2, 64),
        torch.zeros(4, 16, 2, 64),
    )
    kw = dict(head_dim=64, num_qo_heads=8, num_kv_heads=2, rope_base=1e4)
    for over, exc, msg in [
        (dict(kv_layout=1), TypeError, "rope_pool_fused: kv_layout must be a str, got int"),
        (dict(k_scale=1.0), TypeError, "k_scale must be a torch.Tensor, got float"),
        (dict(kv_layout="hnd"), ValueError, 'kv_layout must be "NHD" or "HND", got hnd'),
        ({}, ValueError, "rope_pool_fused expects CUDA or MPS tensors"),
    ]:
        with pytest.raises(exc) as e:
            attnprep.rope_pool_fused(*a, **kw, **over)
        assert str(e.value) == msg
