"""fp8 q in rope_pool_fused and qk_norm_rope: with ``q_scale``, q_rot is float8_e4m3fn holding the q_rot the same
call returns without it, divided by the scale, rounded to nearest even and saturated (attnprep.testing's
quantize_reference), bit for bit; k_rot and the pools unchanged. On the GPU: every kernel path (the rotation kernel's
common shape, table and row paths, GPT-J, partial rotary, the QK norm in the rotation kernel and in the general norm
kernel, M-RoPE, fp8 pools), saturation and NaN rows, CUDA graphs with the scale changed between replays,
torch.compile, opcheck. On the CPU: every message, in order."""

import attnprep
import pytest
import torch
from attnprep.testing import quantize_reference
from conftest import capture, rope_schema_args, same_bits
from torch._subclasses.fake_tensor import FakeTensorMode

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
E4M3 = torch.float8_e4m3fn


def fake_call(T=4, q_scale_shape=(), q_scale_dtype=torch.float32, **kw):
    with FakeTensorMode():
        q, k, v = (torch.empty(T, n, 64, device="cuda") for n in (8, 2, 2))
        positions, slots = (torch.zeros(T, dtype=torch.long, device="cuda") for _ in range(2))
        pools = (torch.empty(16, 2, 64, device="cuda"), torch.empty(16, 2, 64, device="cuda"))
        q_scale = torch.ones(q_scale_shape, dtype=q_scale_dtype, device="cuda")
        kw = dict(dict(head_dim=64, num_qo_heads=8, num_kv_heads=2, rope_base=1e4), **kw)
        return attnprep.rope_pool_fused(q, k, v, positions, slots, *pools, q_scale=q_scale, **kw)


def test_the_fake_kernel_returns_fp8_q():
    for shape in ((), (1,)):
        q_rot, k_rot, _, _ = fake_call(q_scale_shape=shape)
        assert q_rot.dtype == E4M3 and q_rot.shape == (4, 8, 64) and k_rot.dtype == torch.float32


def test_messages_in_order():
    cases = [
        (dict(q_scale_dtype=torch.bfloat16), "q_scale must be float32, got torch.bfloat16"),
        (dict(q_scale_shape=(2,)), "q_scale must have shape [] or [1], got torch.Size([2])"),
        (dict(q_scale_shape=(1, 1)), "q_scale must have shape [] or [1], got torch.Size([1, 1])"),
        (dict(inplace=True), "q_scale needs inplace=False: q_rot is float8_e4m3fn"),
        # earlier checks first: 42 before 44, 37 before 46
        (dict(q_scale_dtype=torch.float16, mrope_interleaved=True), "mrope_interleaved=True needs mrope_section"),
        (dict(inplace=True, norm_eps=0.0), "norm_eps must be a positive finite number, got 0"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError) as e:
            fake_call(**kw)
        assert str(e.value) == message


def test_cpu_tensors_fail_the_device_check_first():
    q, k, v = (torch.randn(3, n, 64) for n in (4, 2, 2))
    positions, slots = torch.arange(3), torch.arange(3)
    pools = [torch.zeros(8, 2, 64) for _ in range(2)]
    kw = dict(head_dim=64, num_qo_heads=4, num_kv_heads=2, rope_base=1e4, q_scale=torch.ones(()))
    with pytest.raises(ValueError) as e:
        attnprep.rope_pool_fused(q, k, v, positions, slots, *pools, **kw)
    assert str(e.value) == "rope_pool_fused expects CUDA or MPS tensors"
    with pytest.raises(TypeError) as e:
        attnprep.rope_pool_fused(q, k, v, positions, slots, *pools, **dict(kw, q_scale=1.0))
    assert str(e.value) == "q_scale must be a torch.Tensor, got float"


def case(T, dtype, hq=8, hkv=2, D=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(4 * torch.randn(T, h, D, device="cuda", dtype=dtype, generator=g) for h in (hq, hkv, hkv))


def with_and_without(q, k, v, positions, slots, pool_dtype, q_scale, **kw):
    """The call without q_scale and with it, each into fresh pools of its own; checks the contract's relation."""
    T, hkv, D = k.shape
    outs = []
    for scale in (None, q_scale):
        if pool_dtype is None:
            pools = (None, None)
        else:
            pools = tuple(torch.full((4 * T + 1, hkv, D), 7, device="cuda").to(pool_dtype) for _ in range(2))
        if pool_dtype in (E4M3, torch.float8_e5m2):
            kw = dict(kw, k_scale=torch.tensor(0.75, device="cuda"), v_scale=torch.tensor([1.5], device="cuda"))
        cache = (v, slots) if pools[0] is not None else (None, None)  # no pools: no v, no slots
        outs.append(attnprep.rope_pool_fused(q, k, cache[0], positions, cache[1], *pools, q_scale=scale, **kw))
    (q_rot, k_rot, kp, vp), (q8, k_rot8, kp8, vp8) = outs
    assert q8.dtype == E4M3 and q8.shape == q.shape and q8.is_contiguous()
    assert same_bits(q8, quantize_reference(q_rot, q_scale, E4M3))
    assert same_bits(k_rot8, k_rot)
    if kp is not None:
        assert same_bits(kp8, kp) and same_bits(vp8, vp)
    return q_rot, q8


SHAPES = {
    "neox": dict(),
    "gptj": dict(is_neox=False),
    "partial": dict(rotary_dim=64),
    "table_rows": dict(table=True),
    "qk_norm": dict(norm=True),
    "qk_norm_rows": dict(norm=True, table=True),
    "qk_norm_gemma_partial": dict(norm=True, rotary_dim=32, norm_weight_offset=1.0),
    "head_dim_96_norm": dict(norm=True, D=96),
    "mrope": dict(mrope=True, table=True),
}


@CUDA
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pool_dtype", [None, "same", E4M3], ids=["no_pools", "pools", "fp8_pools"])
@pytest.mark.parametrize("T", [1, 17, 1100])
def test_bit_for_bit_the_quantized_q_rot(dtype, shape, pool_dtype, T):
    opt = dict(SHAPES[shape])
    D = opt.pop("D", 128)
    q, k, v = case(T, dtype, D=D)
    kw = dict(head_dim=D, num_qo_heads=8, num_kv_heads=2, rope_base=1e4)
    positions = torch.randint(0, 4096, (T,), device="cuda")
    if opt.pop("table", False):
        kw["cos_sin_cache"] = attnprep.rope_cos_sin_cache(D, 4096, 1e4, rotary_dim=opt.get("rotary_dim"), device="cuda")
    if opt.pop("norm", False):
        kw.update(q_norm_weight=torch.rand(D, device="cuda") + 0.5, k_norm_weight=torch.rand(D, device="cuda") + 0.5)
    if opt.pop("mrope", False):
        positions = torch.randint(0, 4096, (3, T), device="cuda")
        kw["mrope_section"] = [16, 24, 24]
    kw.update(opt)
    slots = torch.randperm(4 * T, device="cuda")[:T]
    slots[1::5] = -1
    scale = torch.tensor(0.25 + torch.rand(()).item(), device="cuda")
    pools = dtype if pool_dtype == "same" else pool_dtype
    with_and_without(q, k, v, positions, slots, pools, scale, **kw)


@CUDA
def test_saturation_nan_rows_and_the_division_paths():
    """A scale that saturates most of q at 448, scales outside the reciprocal's exact range, positions outside
    the table (NaN rows stay NaN)."""
    T = 33
    q, k, v = case(T, torch.bfloat16)
    table = attnprep.rope_cos_sin_cache(128, 100, 1e4, device="cuda")
    positions = torch.randint(0, 100, (T,), device="cuda")
    positions[2::7] = 100  # outside the table
    kw = dict(head_dim=128, num_qo_heads=8, num_kv_heads=2, rope_base=1e4, cos_sin_cache=table)
    slots = torch.arange(T, device="cuda")
    for s in (2.0**-9, 2.0**-70, 2.0**70, 3.0):
        _, q8 = with_and_without(q, k, v, positions, slots, torch.bfloat16, torch.tensor([s], device="cuda"), **kw)
        assert q8.float()[2::7].isnan().all() and not q8.float()[0].isnan().any()
    _, q8 = with_and_without(q, k, v, positions, slots, None, torch.tensor(2.0**-9, device="cuda"), **kw)
    assert (q8.float()[0].abs() == 448).float().mean() > 0.5  # saturated, not NaN


@CUDA
def test_the_scale_is_read_on_the_device_in_graphs():
    T = 9
    q, k, v = case(T, torch.bfloat16, D=64)
    positions, slots = torch.arange(T, device="cuda"), torch.arange(T, device="cuda")
    k_pool, v_pool = (torch.zeros(2, 16, 2, 64, device="cuda", dtype=E4M3) for _ in range(2))
    scales = [torch.ones((), device="cuda") for _ in range(3)]
    kw = dict(head_dim=64, num_qo_heads=8, num_kv_heads=2, rope_base=1e4, k_scale=scales[0], v_scale=scales[1])
    call = lambda: attnprep.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, q_scale=scales[2], **kw)  # noqa: E731
    graph, (q8, _, _, _) = capture(call)
    scales[2].fill_(0.125)
    graph.replay()
    torch.cuda.synchronize()
    q_rot, _, _, _ = attnprep.rope_pool_fused(
        q, k, None, positions, None, None, None, **dict(kw, k_scale=None, v_scale=None)
    )
    assert same_bits(q8, quantize_reference(q_rot, scales[2], E4M3))


@CUDA
def test_torch_compile_and_opcheck():
    T = 17
    q, k, v = case(T, torch.bfloat16, D=64)
    positions, slots = torch.randint(0, 500, (T,), device="cuda"), torch.randperm(40, device="cuda")[:T]
    scale = torch.tensor(0.5, device="cuda")
    w = torch.rand(64, device="cuda") + 0.5
    kw = dict(head_dim=64, num_qo_heads=8, num_kv_heads=2, rope_base=1e4, q_norm_weight=w, k_norm_weight=w)

    def f(q, k, v, k_pool, v_pool):
        q8, k_rot, _, _ = attnprep.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, q_scale=scale, **kw)
        return q8, k_rot

    pools = [torch.zeros(40, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    want = f(q, k, v, *pools[:2])
    got = torch.compile(f, fullgraph=True)(q, k, v, *pools[2:])
    assert got[0].dtype == E4M3 and same_bits(got[0], want[0]) and same_bits(got[1], want[1])
    assert same_bits(pools[2], pools[0]) and same_bits(pools[3], pools[1])
    args = rope_schema_args(q, k, v, positions, slots, *pools[:2], q_scale=scale, q_norm_weight=w, k_norm_weight=w)
    torch.library.opcheck(torch.ops.attnprep.rope_pool_fused.default, args)


@CUDA
@pytest.mark.parametrize("norm", ["per_head", "per_token", "none"])
@pytest.mark.parametrize("layout", ["flat", "bshd", "bhsd"])
def test_qk_norm_rope(norm, layout):
    """qk_norm_rope with q_scale: the per-head norm fused, the per-token (Wan) norm before an out-of-place
    rotation, batched inputs that flatten or not; bit for bit the quantized q_rot of the call without it."""
    B, S, H, D = 2, 21, 4, 64
    g = torch.Generator(device="cuda").manual_seed(1)
    if layout == "bhsd":  # [B, H, S, D] seen as [B, S, H, D]: a launch per batch item
        q, k = (torch.randn(B, H, S, D, device="cuda", generator=g).transpose(1, 2) for _ in range(2))
    else:
        q, k = (torch.randn(B, S, H, D, device="cuda", generator=g) for _ in range(2))
        if layout == "flat":
            q, k = q.flatten(0, 1), k.flatten(0, 1)
    q, k = q.bfloat16(), k.bfloat16()
    rows = attnprep.rope_cos_sin_cache(D, S, 1e4, device="cuda")
    kw = dict(cos_sin_cache=rows if layout != "flat" else rows.repeat(B, 1))
    width = H * D if norm == "per_token" else D
    if norm != "none":
        kw.update(q_norm_weight=torch.rand(width, device="cuda") + 0.5, k_norm_weight=torch.rand(width, device="cuda"))
    scale = torch.tensor(0.0625, device="cuda")
    q_rot, k_rot = attnprep.qk_norm_rope(q, k, **kw)
    q_in, k_in = q.clone(), k.clone()
    q8, k_rot8 = attnprep.qk_norm_rope(q, k, q_scale=scale, **kw)
    assert q8.dtype == E4M3 and q8.shape == q.shape
    assert same_bits(q8, quantize_reference(q_rot.flatten(0, -3), scale, E4M3).view(q.shape))
    assert same_bits(k_rot8, k_rot)
    assert same_bits(q, q_in) and same_bits(k, k_in)  # inputs untouched
    with pytest.raises(ValueError) as e:
        attnprep.qk_norm_rope(q, k, q_scale=scale, inplace=True, **kw)
    assert str(e.value) == "q_scale needs inplace=False: q_rot is float8_e4m3fn"
    assert same_bits(q, q_in) and same_bits(k, k_in)
