"""rope_pool_fused against the float64 reference of attnprep.testing (docs/contract.md).

Runs on every GPU backend present: CUDA, and MPS on a Mac (skipped elsewhere).
"""

import os
import subprocess
import sys

import pytest
import torch
from attnprep import rope_pool_fused
from attnprep.testing import cos_sin, rope_error_ratio, rope_reference
from conftest import poison_like, rope_schema_args, same_bits

DEVICES = [
    d
    for d, ok in (
        ("cuda", torch.cuda.is_available()),
        ("mps", getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()),
    )
    if ok
]
requires_gpu = pytest.mark.skipif(not DEVICES, reason="needs a CUDA or MPS device")
on_devices = pytest.mark.parametrize("device", DEVICES or ["none"])

# ---------------------------------------------------------------- reference
# attnprep.testing holds the float64 reference and the documented tolerance.


def assert_close_to_reference(got, want, x, rot, is_neox):
    ratio = rope_error_ratio(got, want, x, rot, is_neox)
    assert ratio <= 1.0, f"error {ratio:.3g}x the bound"


# ---------------------------------------------------------------- inputs


def make_case(
    device,
    T,
    hq,
    hkv,
    D,
    dtype,
    pool_size=None,
    fused=False,
    pos_dtype=torch.int64,
    max_pos=1 << 20,
    pool_row_pad=0,
    seed=0,
):
    g = torch.Generator().manual_seed(seed)
    if fused:  # slices of one [T, (hq + 2 hkv) * D] projection
        qkv = torch.randn(T, (hq + 2 * hkv) * D, generator=g).to(dtype).to(device)
        q, k, v = qkv.split([hq * D, hkv * D, hkv * D], dim=1)
        q, k, v = q.view(T, hq, D), k.view(T, hkv, D), v.view(T, hkv, D)
    else:
        q = torch.randn(T, hq, D, generator=g).to(dtype).to(device)
        k = torch.randn(T, hkv, D, generator=g).to(dtype).to(device)
        v = torch.randn(T, hkv, D, generator=g).to(dtype).to(device)
    pool_size = pool_size or 2 * T + 3
    positions = torch.randint(0, max_pos, (T,), generator=g).to(pos_dtype).to(device)
    slots = torch.randperm(pool_size, generator=g)[:T].to(pos_dtype).to(device)
    # a layer's slice of a larger buffer when pool_row_pad > 0
    kbuf = poison_like((pool_size, hkv * D + pool_row_pad), dtype, device)
    vbuf = poison_like((pool_size, hkv * D + pool_row_pad), dtype, device)
    k_pool = kbuf[:, : hkv * D].view(pool_size, hkv, D) if pool_row_pad else kbuf.view(pool_size, hkv, D)
    v_pool = vbuf[:, : hkv * D].view(pool_size, hkv, D) if pool_row_pad else vbuf.view(pool_size, hkv, D)
    return q, k, v, positions, slots, k_pool, v_pool


def check_case(
    q, k, v, positions, slots, k_pool, v_pool, *, rot=None, is_neox=True, base=10000.0, cache=None, inplace=False
):
    T, hq, D = q.shape
    hkv = k.shape[1]
    rot = rot or D
    pool_before = (k_pool.clone(), v_pool.clone())
    q_in, k_in = q.clone(), k.clone()
    out = rope_pool_fused(
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
        rope_base=base,
        rotary_dim=None if rot == D else rot,
        is_neox=is_neox,
        cos_sin_cache=cache,
        inplace=inplace,
    )
    q_rot, k_rot, kp, vp = out
    assert kp is k_pool and vp is v_pool
    if inplace:
        assert q_rot is q and k_rot is k
    cos, sin = cos_sin(positions, rot, base, cache)
    want_q = rope_reference(q_in, cos, sin, rot, is_neox)
    want_k = rope_reference(k_in, cos, sin, rot, is_neox)
    assert_close_to_reference(q_rot, want_q, q_in, rot, is_neox)
    assert_close_to_reference(k_rot, want_k, k_in, rot, is_neox)
    # pools: rows of valid slots hold exactly k_rot and v; every other byte is unchanged
    want_kp, want_vp = pool_before[0].clone(), pool_before[1].clone()
    sl = slots.long()
    ok = (sl >= 0) & (sl < k_pool.shape[0])
    want_kp[sl[ok]] = k_rot[ok]
    want_vp[sl[ok]] = v[ok]
    assert same_bits(k_pool, want_kp)
    assert same_bits(v_pool, want_vp)
    return out


# ---------------------------------------------------------------- messages


def cpu_args(**over):
    a = dict(
        q=torch.randn(4, 8, 64),
        k=torch.randn(4, 2, 64),
        v=torch.randn(4, 2, 64),
        positions=torch.arange(4),
        slots=torch.arange(4),
        k_pool=torch.zeros(16, 2, 64),
        v_pool=torch.zeros(16, 2, 64),
    )
    kw = dict(head_dim=64, num_qo_heads=8, num_kv_heads=2, rope_base=10000.0)
    for key, val in over.items():
        (a if key in a else kw)[key] = val
    return a, kw


def raises(msg, **over):
    a, kw = cpu_args(**over)
    with pytest.raises(ValueError) as e:
        rope_pool_fused(*a.values(), **kw)
    assert str(e.value) == msg


def test_documented_messages_in_order():
    raises("rope_pool_fused expects q/k/v to be 3-D", q=torch.randn(4, 512))
    raises("rope_pool_fused expects q/k/v to be 3-D", v=torch.randn(4, 2, 64, 1), positions=torch.zeros(4, 1))
    raises("rope_pool_fused expects positions/slots to be 1-D", slots=torch.zeros(4, 1, dtype=torch.long))
    raises("rope_pool_fused expects pool tensors to be 3-D", k_pool=torch.zeros(16, 128), q=torch.randn(4, 8, 32))
    raises("q shape must be [num_tokens, num_qo_heads, head_dim], got torch.Size([4, 8, 64])", num_qo_heads=4)
    raises("q shape must be [num_tokens, num_qo_heads, head_dim], got torch.Size([4, 8, 32])", q=torch.randn(4, 8, 32))
    raises("k shape must be [num_tokens, num_kv_heads, head_dim], got torch.Size([5, 2, 64])", k=torch.randn(5, 2, 64))
    raises("k shape must be [num_tokens, num_kv_heads, head_dim], got torch.Size([4, 2, 64])", num_kv_heads=1)
    raises("v shape must match k shape, got torch.Size([4, 3, 64]) vs torch.Size([4, 2, 64])", v=torch.randn(4, 3, 64))
    raises("positions/slots must have one entry per token", positions=torch.arange(5))
    raises("positions/slots must have one entry per token", slots=torch.arange(3))
    raises("k_pool has incompatible shape torch.Size([16, 2, 32])", k_pool=torch.zeros(16, 2, 32))
    raises(
        "v_pool shape must match k_pool shape, got torch.Size([8, 2, 64]) vs torch.Size([16, 2, 64])",
        v_pool=torch.zeros(8, 2, 64),
    )
    raises("q/k/v dtypes must match", k=torch.randn(4, 2, 64).half())
    raises("q/k/v dtypes must match", v=torch.randn(4, 2, 64).double(), k_pool=torch.zeros(16, 2, 64).half())
    raises("pool dtypes must match q/k/v dtype", v_pool=torch.zeros(16, 2, 64).half())


def test_arguments_of_the_wrong_type_are_type_errors():
    a, kw = cpu_args()
    for name in ("q", "k", "v", "positions", "slots", "k_pool", "v_pool"):
        for bad in (None, [1, 2]) if name in ("q", "k") else ([1, 2],):  # positions=None: per-token cos/sin
            args = dict(a, **{name: bad})
            with pytest.raises(TypeError) as e:
                rope_pool_fused(*args.values(), **kw)
            assert str(e.value) == f"{name} must be a torch.Tensor, got {type(bad).__name__}"
    for name in ("v", "slots", "k_pool", "v_pool"):  # the cache write whole (all None: none of it) or nothing
        with pytest.raises(ValueError) as e:
            rope_pool_fused(*dict(a, **{name: None}).values(), **kw)
        assert str(e.value) == "v, slots, k_pool and v_pool must be given together or all be None"
    for name, bad, kind in [
        ("head_dim", "64", "an int"),
        ("num_qo_heads", 8.0, "an int"),
        ("num_kv_heads", None, "an int"),
        ("rotary_dim", 2.5, "an int"),
        ("rope_base", "1e4", "a number"),
        ("is_neox", 1, "a bool"),
        ("inplace", None, "a bool"),
    ]:
        with pytest.raises(TypeError) as e:
            rope_pool_fused(*a.values(), **dict(kw, **{name: bad}))
        assert str(e.value) == f"rope_pool_fused: {name} must be {kind}, got {type(bad).__name__}"
    with pytest.raises(TypeError) as e:
        rope_pool_fused(*a.values(), **dict(kw, cos_sin_cache="table"))
    assert str(e.value) == "cos_sin_cache must be a torch.Tensor, got str"


def test_huge_ints_get_the_shape_message():
    raises("q shape must be [num_tokens, num_qo_heads, head_dim], got torch.Size([4, 8, 64])", num_qo_heads=2**64)
    raises("q shape must be [num_tokens, num_qo_heads, head_dim], got torch.Size([4, 8, 64])", head_dim=-(2**70))


def test_library_checks_reachable_on_cpu():
    raises("rope_pool_fused expects CUDA or MPS tensors")
    h = lambda *s: torch.randn(*s).half()  # noqa: E731
    a = dict(
        q=h(4, 8, 64).double(),
        k=h(4, 2, 64).double(),
        v=h(4, 2, 64).double(),
        k_pool=torch.zeros(16, 2, 64).double(),
        v_pool=torch.zeros(16, 2, 64).double(),
    )
    raises("rope_pool_fused expects CUDA or MPS tensors", **a)


@requires_gpu
@on_devices
def test_library_checks(device):
    T = 4
    base = dict(
        q=torch.randn(T, 8, 64, device=device),
        k=torch.randn(T, 2, 64, device=device),
        v=torch.randn(T, 2, 64, device=device),
        positions=torch.arange(T, device=device),
        slots=torch.arange(T, device=device),
        k_pool=torch.zeros(16, 2, 64, device=device),
        v_pool=torch.zeros(16, 2, 64, device=device),
    )

    def bad(msg, **over):
        args = dict(base)
        kw = dict(head_dim=64, num_qo_heads=8, num_kv_heads=2, rope_base=10000.0)
        for key, val in over.items():
            (args if key in args else kw)[key] = val
        with pytest.raises(ValueError) as e:
            rope_pool_fused(*args.values(), **kw)
        assert str(e.value) == msg

    bad("rope_pool_fused expects all tensors on one device", slots=torch.arange(T))
    bad("rope_pool_fused expects all tensors on one device", cos_sin_cache=torch.zeros(8, 64))
    if device == "cuda":
        f64 = {n: t.double() for n, t in base.items() if t.is_floating_point()}
        bad("rope_pool_fused supports float16, bfloat16 and float32, got torch.float64", **f64)
    odd = dict(
        q=torch.randn(T, 8, 63, device=device),
        k=torch.randn(T, 2, 63, device=device),
        v=torch.randn(T, 2, 63, device=device),
        k_pool=torch.zeros(16, 2, 63, device=device),
        v_pool=torch.zeros(16, 2, 63, device=device),
    )
    bad("rope_pool_fused expects an even head_dim in [2, 512], got 63", head_dim=63, **odd)
    bad("rope_pool_fused expects an even rotary_dim in [2, head_dim], got 31", rotary_dim=31)
    bad("rope_pool_fused expects an even rotary_dim in [2, head_dim], got 66", rotary_dim=66)
    bad("rope_pool_fused expects an even rotary_dim in [2, head_dim], got 0", rotary_dim=0)
    bad("rope_pool_fused expects int32 or int64 positions/slots", positions=torch.arange(T, device=device).float())
    bad("rope_pool_fused expects int32 or int64 positions/slots", slots=torch.arange(T, device=device).short())
    bad(
        "rope_pool_fused expects q, k, v and the pools to be contiguous in head_dim",
        k=torch.randn(T, 2, 128, device=device)[..., ::2],
    )
    bad(
        "rope_pool_fused expects q, k, v and the pools to be contiguous in head_dim",
        v_pool=torch.zeros(16, 2, 128, device=device)[..., ::2],
    )
    bad(
        "cos_sin_cache must have shape [max_position, rotary_dim] = [*, 64], got torch.Size([8, 32])",
        cos_sin_cache=torch.zeros(8, 32, device=device),
    )
    bad(
        "cos_sin_cache must be float32 or bfloat16, got torch.float16",
        cos_sin_cache=torch.zeros(8, 64, device=device, dtype=torch.float16),
    )
    bad("rope_base must be a positive number", rope_base=0.0)
    bad("rope_base must be a positive number", rope_base=float("nan"))
    bad("rope_pool_fused expects an even rotary_dim in [2, head_dim], got -2", rotary_dim=-2)


POOLS_OVERLAP = "k_pool and v_pool must not overlap each other or themselves"
POOLS_VS_INPUTS = "k_pool and v_pool must not overlap q, k, v, positions, slots, cos_sin_cache or the scales"
INPLACE_OVERLAP = (
    "with inplace=True, q and k must not overlap each other, themselves, v, positions, slots, "
    "cos_sin_cache or the scales"
)


@requires_gpu
@on_devices
def test_overlapping_writes_are_refused_and_nothing_is_written(device):
    T = 5
    q, k, v = (
        torch.randn(T, 8, 64, device=device),
        torch.randn(T, 2, 64, device=device),
        torch.randn(T, 2, 64, device=device),
    )
    positions, slots = torch.arange(T, device=device), torch.arange(T, device=device)
    buf = torch.randn(16, 2, 2, 64, device=device)  # one combined [slots, 2, heads, D] cache
    k_pool, v_pool = buf[:, 0], buf[:, 1]
    kw = dict(head_dim=64, num_qo_heads=8, num_kv_heads=2, rope_base=1e4)

    def refused(msg, *args, **over):
        before = [t.clone() for t in (q, k, v, buf)]
        with pytest.raises(ValueError) as e:
            rope_pool_fused(*args, **dict(kw, **over))
        assert str(e.value) == msg
        torch.cuda.synchronize() if device == "cuda" else None
        assert all(same_bits(a, b) for a, b in zip(before, (q, k, v, buf)))  # nothing launched

    refused(POOLS_OVERLAP, q, k, v, positions, slots, k_pool, k_pool)
    refused(POOLS_OVERLAP, q, k, v, positions, slots, buf.view(32, 2, 64)[1:17], buf.view(32, 2, 64)[16:])
    refused(POOLS_OVERLAP, q, k, v, positions, slots, k_pool[:1].expand(16, 2, 64), v_pool)
    refused(POOLS_VS_INPUTS, k_pool[:T], k_pool[:T], v, positions, slots, k_pool, v_pool, num_qo_heads=2)
    refused(POOLS_VS_INPUTS, q, k, v_pool[:T], positions, slots, k_pool, v_pool)
    qk = torch.randn(T, 10, 64, device=device)
    refused(INPLACE_OVERLAP, qk[:, :8], qk[:, 7:9], v, positions, slots, k_pool, v_pool, inplace=True)
    refused(INPLACE_OVERLAP, q[:1].expand(T, 8, 64), k, v, positions, slots, k_pool, v_pool, inplace=True)
    # what servers pass is accepted: k and v halves of one cache, q and k slices of one projection in place
    qkv = torch.randn(T, 12 * 64, device=device)
    qs, ks, vs = (t.view(T, -1, 64) for t in qkv.split([8 * 64, 2 * 64, 2 * 64], dim=1))
    want_q = rope_pool_fused(qs.clone(), ks.clone(), vs, positions, slots, k_pool.clone(), v_pool.clone(), **kw)[0]
    got = rope_pool_fused(qs, ks, vs, positions, slots, k_pool, v_pool, inplace=True, **kw)
    assert got[0] is qs and same_bits(qs, want_q)
    assert same_bits(buf[:T, 1], vs)


@requires_gpu
@on_devices
def test_head_counts_past_the_kernel_limit_are_refused(device):
    T = 3
    q = torch.randn(1, 1, 64, device=device).expand(T, 2**31, 64)  # stride 0: no memory
    k = torch.randn(T, 1, 64, device=device)
    a = (
        q,
        k,
        k.clone(),
        torch.arange(T, device=device),
        torch.arange(T, device=device),
        torch.zeros(4, 1, 64, device=device),
        torch.zeros(4, 1, 64, device=device),
    )
    with pytest.raises(ValueError) as e:
        rope_pool_fused(*a, head_dim=64, num_qo_heads=2**31, num_kv_heads=1, rope_base=1e4)
    assert str(e.value) == "rope_pool_fused supports num_qo_heads + num_kv_heads <= 65536, got 2147483649"


# ---------------------------------------------------------------- correctness

HEADS = [(32, 8), (8, 1), (28, 4), (16, 16)]


@requires_gpu
@on_devices
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_matches_reference(device, dtype, head_dim, heads, is_neox):
    hq, hkv = heads
    case = make_case(device, 37, hq, hkv, head_dim, dtype, seed=head_dim + hq)
    check_case(*case, is_neox=is_neox)


@requires_gpu
@on_devices
@pytest.mark.parametrize("rot", [16, 32, 34, 48, 6, 2])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("T", [17, 1100])
def test_partial_rotary(device, rot, is_neox, dtype, T):
    case = make_case(device, T, 8, 2, 64, dtype, seed=rot)
    check_case(*case, rot=rot, is_neox=is_neox)


@requires_gpu
@on_devices
@pytest.mark.parametrize(
    "head_dim, rot, dtype",
    [
        (72, 72, torch.bfloat16),  # GPT-J: 9 groups of 8 (odd); NeoX: half 36, one element at a time (72, paired)
        (72, 64, torch.bfloat16),  # 9 groups of 8 either way (NeoX: 4 rotated pairs of groups + 1 passed through)
        (68, 68, torch.float32),  # GPT-J: 17 groups of 4; NeoX: half 34, one element at a time
        (80, 48, torch.float16),  # 10 groups of 8 (even): v items pair groups j and j + 5
    ],
    ids=str,
)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("T", [17, 1100])
def test_v_heads_with_odd_and_even_group_counts(device, head_dim, rot, dtype, is_neox, T):
    """A CUDA work item of v is two groups half a head apart when the head has
    an even number of groups, one group when odd; both, split tokens and
    whole-token blocks, against the reference (pool rows included)."""
    case = make_case(device, T, 6, 3, head_dim, dtype, seed=head_dim + rot + T)
    check_case(*case, rot=rot, is_neox=is_neox)


@requires_gpu
@on_devices
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("T", [1, 17, 65, 1000, 1024, 3001])  # >= 1024: one block per token, many items a thread
def test_positions_and_sizes(device, pos_dtype, T):
    case = make_case(device, T, 8, 2, 128, torch.bfloat16, pos_dtype=pos_dtype, max_pos=1 << 20, seed=T)
    check_case(*case, base=500000.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Metal's sin/cos: a few ulp)")
def test_cos_sin_within_half_an_ulp():
    """float32 q heads of (1, 0) NeoX pairs rotate into the kernel's (cos,
    sin) of each float32 angle exactly: each within 0.501 float32 ulp of the
    float64 value (docs/contract.md), at fresh random positions below 2^20
    (angles up to 1e6 rad; the contract's bound holds below 2^52 rad)."""
    T, D = 301, 128
    positions = torch.randint(0, 1 << 20, (T,))
    q = torch.zeros(T, 1, D)
    q[..., : D // 2] = 1.0
    q, k, v = q.cuda(), q.cuda(), torch.zeros(T, 1, D, device="cuda")
    slots = torch.full((T,), -1, dtype=torch.int64, device="cuda")
    pool = torch.zeros(1, 1, D, device="cuda")
    q_rot, _, _, _ = rope_pool_fused(
        q,
        k,
        v,
        positions.cuda(),
        slots,
        pool,
        pool.clone(),
        head_dim=D,
        num_qo_heads=1,
        num_kv_heads=1,
        rope_base=10000.0,
    )
    cos, sin = cos_sin(positions, D, 10000.0)
    for got, want in ((q_rot[:, 0, : D // 2], cos), (q_rot[:, 0, D // 2 :], sin)):
        ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp(min=2.0**-126))) - 23)
        assert ((got.cpu().double() - want).abs() / ulp).max().item() <= 0.501


@requires_gpu
@on_devices
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rot", [256, 96], ids=["full", "partial"])
def test_many_items_per_token(device, dtype, is_neox, rot):
    """From 1024 tokens a CUDA block serves a whole token; with 48/8 heads of
    256 a token is 1152 (16-bit) or 2304 (fp32) 16-byte items: 9 or 18 rounds of
    128 threads, so several staging chunks per thread. Slices of a fused
    projection."""
    case = make_case(device, 1031, 48, 8, 256, dtype, fused=True, seed=rot)
    check_case(*case, rot=rot, is_neox=is_neox)


@requires_gpu
@on_devices
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("tokens", [1023, 1024, 4501])
def test_either_side_of_one_block_per_token(device, is_neox, inplace, tokens):
    """Below 1024 tokens each CUDA block serves one round of a token's items;
    from 1024 a block walks all of a token's rounds and asks L2 for each
    thread's next item ahead (ATTNPREP_ROPE_PREFETCH_AHEAD): another
    instantiation of the kernel."""
    case = make_case(device, tokens, 32, 8, 128, torch.bfloat16, fused=True, seed=tokens)
    check_case(*case, is_neox=is_neox, inplace=inplace)


@requires_gpu
@on_devices
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_many_items_per_token_with_cache(device, is_neox):
    cache = llama3_cos_sin_cache(128, 4096).to(device)
    case = make_case(device, 1500, 32, 8, 128, torch.bfloat16, max_pos=4096, seed=7)
    case[4][::5] = -1  # some tokens skip the pool
    check_case(*case, cache=cache, is_neox=is_neox)


@requires_gpu
@on_devices
def test_large_angles_are_accurate(device):
    """Positions near 2^20 with inv_freq[0] = 1: angles of ~1e6 rad need real range reduction."""
    case = make_case(device, 64, 4, 4, 64, torch.float32, seed=5)
    case[3].copy_(torch.arange((1 << 20) - 64, 1 << 20, device=device))
    check_case(*case)


@requires_gpu
@on_devices
def test_slots_negative_and_out_of_range(device):
    q, k, v, positions, slots, k_pool, v_pool = make_case(device, 65, 8, 2, 128, torch.float16, pool_size=100)
    slots[::3] = -1
    slots[1::7] = 100  # == pool_size: never written
    slots[2::11] = 1 << 40 if slots.dtype == torch.int64 else 2**31 - 1
    check_case(q, k, v, positions, slots, k_pool, v_pool)


@requires_gpu
@on_devices
def test_repeated_slots_leave_other_rows_exact(device):
    """Two tokens on one slot (docs/contract.md): that row holds, 4-byte
    word by word (what PTX guarantees of a vector store), one of the two
    tokens' values; every other row is exact."""
    q, k, v, positions, slots, k_pool, v_pool = make_case(device, 65, 8, 4, 128, torch.bfloat16, pool_size=100)
    slots[40] = slots[3]
    shared = int(slots[3])
    before = (k_pool.clone(), v_pool.clone())
    k_rot = rope_pool_fused(
        q, k, v, positions, slots, k_pool, v_pool, head_dim=128, num_qo_heads=8, num_kv_heads=4, rope_base=10000.0
    )[1]
    for pool, was, src in ((k_pool, before[0], k_rot), (v_pool, before[1], v)):
        want = was.clone()
        want[slots.long()] = src  # the shared row: token 40's, checked apart below
        others = torch.ones(pool.shape[0], dtype=torch.bool, device=device)
        others[shared] = False
        assert same_bits(pool[others], want[others])
        words = pool[shared].reshape(-1, 2).view(torch.int16)  # pairs of bf16
        first, second = (src[t].reshape(-1, 2).view(torch.int16) for t in (3, 40))
        assert bool(((words == first).all(1) | (words == second).all(1)).all())


@requires_gpu
@on_devices
def test_check_slots_raises_before_writing(device):
    q, k, v, positions, slots, k_pool, v_pool = make_case(device, 9, 8, 2, 64, torch.bfloat16, pool_size=20)
    slots[4] = 20
    before = k_pool.clone()
    kw = dict(head_dim=64, num_qo_heads=8, num_kv_heads=2, rope_base=1e4)
    with pytest.raises(ValueError) as e:
        rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, check_slots=True, **kw)
    assert str(e.value) == "slots must be < pool_size"
    assert same_bits(k_pool, before)
    # the documented checks still come first
    with pytest.raises(ValueError) as e:
        rope_pool_fused(q, k, v.float(), positions, slots, k_pool, v_pool, check_slots=True, **kw)
    assert str(e.value) == "q/k/v dtypes must match"
    slots[4] = 19
    rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, check_slots=True, **kw)


@requires_gpu
@on_devices
def test_check_slots_from_the_environment(device):
    code = (
        "import torch, attnprep\n"
        f"d = {device!r}\n"
        "q = torch.randn(3, 2, 64, device=d); k = torch.randn(3, 1, 64, device=d)\n"
        "pool = torch.zeros(4, 1, 64, device=d)\n"
        "slots = torch.tensor([0, 4, 1], device=d)\n"
        "try:\n"
        "    attnprep.rope_pool_fused(q, k, k.clone(), torch.arange(3, device=d), slots, pool, pool.clone(),\n"
        "                             head_dim=64, num_qo_heads=2, num_kv_heads=1, rope_base=1e4)\n"
        "except ValueError as e:\n"
        "    assert str(e) == 'slots must be < pool_size', str(e)\n"
        "    assert not pool.any()\n"
        "else:\n"
        "    raise SystemExit('no ValueError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, ATTNPREP_CHECK_SLOTS="1"))


@requires_gpu
@on_devices
@pytest.mark.parametrize("pad", [0, 3 * 2 * 128])
def test_strided_inputs_and_row_strided_pools(device, pad):
    case = make_case(device, 65, 32, 8, 128, torch.bfloat16, fused=True, pool_row_pad=pad, seed=pad)
    check_case(*case)


@requires_gpu
@on_devices
def test_misaligned_inputs_take_the_scalar_path(device):
    T, hq, hkv, D = 33, 4, 2, 64
    base = torch.randn(T * (hq + 2 * hkv) * D + 1, device=device, dtype=torch.bfloat16)[1:]
    q, k, v = base.view(T, -1).split([hq * D, hkv * D, hkv * D], dim=1)
    _, _, _, positions, slots, k_pool, v_pool = make_case(device, T, hq, hkv, D, torch.bfloat16)
    check_case(q.view(T, hq, D), k.view(T, hkv, D), v.view(T, hkv, D), positions, slots, k_pool, v_pool)


def llama3_cos_sin_cache(rot, max_pos, base=500000.0, factor=8.0, low=1.0, high=4.0, orig=8192):
    """A Llama-3-scaled table, built the way vLLM builds it (float32)."""
    inv = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    wavelen = 2 * torch.pi / inv
    low_wl, high_wl = orig / low, orig / high
    smooth = (orig / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wl, inv / factor, inv)
    mid = (wavelen <= low_wl) & (wavelen >= high_wl)
    scaled = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), scaled)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@requires_gpu
@on_devices
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_cos_sin_cache_llama3(device, cache_dtype, is_neox):
    cache = llama3_cos_sin_cache(128, 4096).to(cache_dtype).to(device)
    case = make_case(device, 65, 32, 8, 128, torch.bfloat16, max_pos=4096)
    check_case(*case, cache=cache, is_neox=is_neox)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("offset", [0, 1, 4, 8])
@pytest.mark.parametrize("T", [65, 1500])
def test_cos_sin_cache_at_any_alignment(cache_dtype, offset, T):
    """The CUDA kernel reads cos/sin straight from a row whose start and sin half
    sit on 16-byte boundaries, and through its block table otherwise: a table
    that starts `offset` elements into a larger buffer, with a row stride of
    rot + offset, takes either path and must give the same rows."""
    rot, max_pos = 128, 4096
    table = llama3_cos_sin_cache(rot, max_pos).to(cache_dtype).cuda()
    buf = torch.full((max_pos + 1, rot + offset), float("nan"), dtype=cache_dtype, device="cuda")
    cache = buf.view(-1)[offset : offset + max_pos * (rot + offset)].view(max_pos, rot + offset)[:, :rot]
    cache.copy_(table)
    case = make_case("cuda", T, 32, 8, 128, torch.bfloat16, max_pos=max_pos, seed=T + offset)
    case[4][::7] = -1  # some tokens skip the pool
    check_case(*case, cache=cache)


@requires_gpu
@on_devices
def test_cos_sin_cache_partial_rotary(device):
    cache = llama3_cos_sin_cache(32, 1000).to(device)
    case = make_case(device, 17, 8, 2, 128, torch.float16, max_pos=1000)
    check_case(*case, cache=cache, rot=32)


@requires_gpu
@on_devices
def test_positions_outside_the_cache_are_never_read(device):
    cache = llama3_cos_sin_cache(64, 100).to(device)
    q, k, v, positions, slots, k_pool, v_pool = make_case(device, 8, 4, 2, 64, torch.float32, max_pos=100)
    positions[3] = 100
    positions[5] = -1
    before = k_pool.clone()
    kw = dict(head_dim=64, num_qo_heads=4, num_kv_heads=2, rope_base=1e4, cos_sin_cache=cache)
    with pytest.raises(ValueError) as e:
        rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, check_slots=True, **kw)
    assert str(e.value) == "positions must be in [0, cos_sin_cache.shape[0])"
    q_rot, k_rot, _, _ = rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, **kw)
    bad = torch.zeros(8, dtype=torch.bool, device=device)
    bad[3] = bad[5] = True
    assert torch.isnan(q_rot[bad]).all() and not torch.isnan(q_rot[~bad]).any()
    for t in (3, 5):  # no pool write for those tokens
        assert same_bits(k_pool[slots[t]], before[slots[t]])


@requires_gpu
@on_devices
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T", [8, 2048])  # one round per block; several rounds
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "qk_norm"])
def test_positions_outside_the_cache_on_the_cache_row_path(device, dtype, cache_dtype, T, norm):
    # head_dim 128 with 16-byte groups: the path that reads each item's cos/sin
    # from the token's cache row. A token whose position is outside the cache
    # gets NaN q_rot/k_rot rows and no pool write; every other token's outputs
    # and pool rows are exactly those of a call where all positions are valid.
    D, hq, hkv = 128, 8, 2
    cache = llama3_cos_sin_cache(D, 100).to(device=device, dtype=cache_dtype)
    q, k, v, positions, slots, k_pool, v_pool = make_case(device, T, hq, hkv, D, dtype, max_pos=100)
    bad = torch.zeros(T, dtype=torch.bool, device=device)
    bad[2::3] = True  # positions 100 and -1 in turn
    outside = torch.where(torch.arange(T, device=device) % 2 == 0, 100, -1).to(positions.dtype)
    kw = dict(head_dim=D, num_qo_heads=hq, num_kv_heads=hkv, rope_base=1e4, cos_sin_cache=cache)
    if norm:
        g = torch.Generator().manual_seed(1)
        kw.update(
            q_norm_weight=torch.randn(D, generator=g).to(dtype).to(device),
            k_norm_weight=torch.randn(D, generator=g).to(dtype).to(device),
        )
    pools_before = (k_pool.clone(), v_pool.clone())
    valid = rope_pool_fused(q, k, v, positions, slots, k_pool.clone(), v_pool.clone(), **kw)
    got = rope_pool_fused(q, k, v, torch.where(bad, outside, positions), slots, k_pool, v_pool, **kw)
    for out, want in zip(got[:2], valid[:2]):  # q_rot, k_rot
        assert torch.isnan(out[bad]).all() and not torch.isnan(out[~bad]).any()
        assert same_bits(out[~bad], want[~bad])
    sl = slots.long()
    for pool, before, want in zip(got[2:], pools_before, valid[2:]):
        assert same_bits(pool[sl[bad]], before[sl[bad]])  # no write for those tokens
        assert same_bits(pool[sl[~bad]], want[sl[~bad]])
        untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=device)
        untouched[sl] = False
        assert same_bits(pool[untouched], before[untouched])


@requires_gpu
@on_devices
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("T", [33, 2048])
def test_inplace(device, is_neox, T):
    case = make_case(device, T, 28, 4, 128, torch.bfloat16, fused=True)
    check_case(*case, inplace=True, is_neox=is_neox)


@requires_gpu
@on_devices
def test_empty(device):
    q, k, v, positions, slots, k_pool, v_pool = make_case(device, 0, 8, 2, 64, torch.float16, pool_size=4)
    before = k_pool.clone()
    q_rot, k_rot, _, _ = rope_pool_fused(
        q, k, v, positions, slots, k_pool, v_pool, head_dim=64, num_qo_heads=8, num_kv_heads=2, rope_base=1e4
    )
    assert q_rot.shape == (0, 8, 64) and k_rot.shape == (0, 2, 64) and same_bits(k_pool, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T", [8, 1500])
def test_dependent_calls_back_to_back(T):
    """Each call rotates the previous call's q_rot/k_rot, copies its k_rot as v,
    and rewrites the same pool rows, with no other kernel in between. Where
    kernels launch with programmatic dependent launch (compute capability 9.0
    and up) the next one starts before the previous ends and must wait for its
    writes: eagerly and as one CUDA graph, the chain must be bit-equal to the
    same calls with a synchronize after each (the kernel is deterministic)."""
    q, k, v, positions, slots, k_pool, v_pool = make_case("cuda", T, 32, 8, 128, torch.bfloat16, seed=T)
    kw = dict(head_dim=128, num_qo_heads=32, num_kv_heads=8, rope_base=1e4)
    pools0 = (k_pool.clone(), v_pool.clone())

    def chain(sync):
        a, b, c = q, k, v
        outs = []
        for _ in range(6):
            a, b, _, _ = rope_pool_fused(a, b, c, positions, slots, k_pool, v_pool, **kw)
            if sync:
                torch.cuda.synchronize()
            c = b
            outs += [a, b]
        return outs

    def reset_pools():
        k_pool.copy_(pools0[0])
        v_pool.copy_(pools0[1])

    want = [o.clone() for o in chain(sync=True)]
    want_pools = (k_pool.clone(), v_pool.clone())
    assert same_bits(want_pools[1][slots], want[-3])  # v of the last call: k_rot of the one before
    for check in ("eager", "graph"):
        reset_pools()
        if check == "eager":
            got = chain(sync=False)
        else:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                got = chain(sync=False)
            reset_pools()
            for o in got:
                o.copy_(poison_like(o.shape, o.dtype, o.device))
            g.replay()
        torch.cuda.synchronize()
        assert all(same_bits(x, y) for x, y in zip(got, want)), check
        assert same_bits(k_pool, want_pools[0]) and same_bits(v_pool, want_pools[1]), check


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_capture_and_replay():
    q, k, v, positions, slots, k_pool, v_pool = make_case("cuda", 65, 32, 8, 128, torch.bfloat16)
    kw = dict(head_dim=128, num_qo_heads=32, num_kv_heads=8, rope_base=1e4)
    rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, **kw)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q_rot, k_rot, _, _ = rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, **kw)
    for seed in range(3):
        fresh = make_case("cuda", 65, 32, 8, 128, torch.bfloat16, seed=100 + seed)
        for dst, src in zip((q, k, v, positions, slots), fresh[:5]):
            dst.copy_(src)
        g.replay()
        torch.cuda.synchronize()
        cos, sin = cos_sin(positions, 128, 1e4)
        assert_close_to_reference(q_rot, rope_reference(q, cos, sin, 128, True), q, 128, True)
        assert same_bits(k_pool[slots.long()], k_rot) and same_bits(v_pool[slots.long()], v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("inplace", [False, True])
def test_torch_compile(inplace):
    q, k, v, positions, slots, k_pool, v_pool = make_case("cuda", 17, 8, 2, 64, torch.float32)
    kw = dict(head_dim=64, num_qo_heads=8, num_kv_heads=2, rope_base=1e4, inplace=inplace)

    def f(q, k, v, positions, slots, k_pool, v_pool):
        q_rot, k_rot, kp, vp = rope_pool_fused(q * 1, k * 1, v, positions, slots, k_pool, v_pool, **kw)
        return q_rot + 1, k_rot.sum()

    k_pool2, v_pool2 = k_pool.clone(), v_pool.clone()
    got = torch.compile(f, fullgraph=True)(q, k, v, positions, slots, k_pool, v_pool)
    want = f(q, k, v, positions, slots, k_pool2, v_pool2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert same_bits(k_pool, k_pool2) and same_bits(v_pool, v_pool2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_opcheck():
    q, k, v, positions, slots, k_pool, v_pool = make_case("cuda", 9, 8, 2, 64, torch.float16)
    for rotary_dim, check_slots in [(None, False), (32, True)]:
        args = rope_schema_args(q, k, v, positions, slots, k_pool, v_pool, check_slots, rotary_dim=rotary_dim)
        torch.library.opcheck(torch.ops.attnprep.rope_pool_fused.default, args)
    args = rope_schema_args(q.clone(), k.clone(), v, positions, slots, k_pool, v_pool)
    torch.library.opcheck(torch.ops.attnprep.rope_pool_fused_inplace.default, args)
