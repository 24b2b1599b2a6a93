"""M-RoPE in rope_pool_fused: positions [3, T] with mrope_section (sections as
Qwen2-VL / Qwen2.5-VL, interleaved as Qwen3-VL). On the GPU: bit for bit the
per-token rows that attnprep.testing.mrope_cos_sin_rows gathers (itself bit
for bit transformers' own, tests/python/test_mrope_reference.py), a float64
reference from rope_base, strided positions and slots, out-of-table positions,
fp8 paged pools, CUDA graphs and torch.compile. On the CPU: every message."""

import attnprep
import pytest
import torch
from attnprep.testing import cos_sin, mrope_axes, mrope_cos_sin_rows, rope_error_ratio, rope_reference
from conftest import rope_schema_args
from torch._subclasses.fake_tensor import FakeTensorMode

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
KW = dict(head_dim=64, num_qo_heads=8, num_kv_heads=2, rope_base=1e4)


def fake_call(positions_shape=(3, 4), T=4, **kw):
    with FakeTensorMode():
        q, k, v = (torch.empty(T, n, 64, device="cuda") for n in (8, 2, 2))
        slots = torch.zeros(T, dtype=torch.long, device="cuda")
        pools = (torch.empty(16, 2, 64, device="cuda"), torch.empty(16, 2, 64, device="cuda"))
        positions = None if positions_shape is None else torch.zeros(positions_shape, dtype=torch.long, device="cuda")
        return attnprep.rope_pool_fused(q, k, v, positions, slots, *pools, **KW, **kw)


def test_sections_and_positions_are_checked_in_order():
    q_rot, _, _, _ = fake_call(mrope_section=[8, 12, 12])
    assert q_rot.shape == (4, 8, 64)
    fake_call(mrope_section=(8, 12, 12), mrope_interleaved=True)
    fake_call(mrope_section=[4, 6, 6], rotary_dim=32)
    cases = [
        (dict(mrope_section=[8, 12, 13]), "got [8, 12, 13]"),
        (dict(mrope_section=[20, 12]), "got [20, 12]"),
        (dict(mrope_section=(40, -4, -4)), "got [40, -4, -4]"),
    ]
    for kw, got in cases:
        with pytest.raises(ValueError) as e:
            fake_call(**kw)
        assert (
            str(e.value) == "mrope_section must be three non-negative integers summing to rotary_dim / 2 = 32, " + got
        )
    with pytest.raises(ValueError) as e:
        fake_call((4,), mrope_interleaved=True)
    assert str(e.value) == "mrope_interleaved=True needs mrope_section"
    for shape, got in (((4,), "torch.Size([4])"), ((3, 5), "torch.Size([3, 5])"), ((2, 4), "torch.Size([2, 4])")):
        with pytest.raises(ValueError) as e:
            fake_call(shape, mrope_section=[8, 12, 12])
        assert str(e.value) == f"M-RoPE positions must have shape [3, num_tokens] = [3, 4], got {got}"
    with pytest.raises(ValueError) as e:
        fake_call((3, 4))  # 2-D positions without sections: check 2
    assert str(e.value) == "rope_pool_fused expects positions/slots to be 1-D"
    with pytest.raises(ValueError) as e:
        fake_call((3, 4), mrope_section=[8, 12, 13], norm_eps=0.0)  # check 37 before 41
    assert str(e.value) == "norm_eps must be a positive finite number, got 0"


def test_a_section_that_is_not_a_list_is_a_type_error():
    for section, name in (("8,12,12", "str"), (8, "int"), (torch.tensor([8, 12, 12]), "Tensor")):
        with pytest.raises(TypeError) as e:
            fake_call(mrope_section=section)
        assert str(e.value) == f"rope_pool_fused: mrope_section must be a list or tuple of ints, got {name}"
    with pytest.raises(TypeError) as e:
        fake_call(mrope_section=[8, 12.0, 12])
    assert str(e.value) == "rope_pool_fused: mrope_section must be an int, got float"
    with pytest.raises(TypeError) as e:
        fake_call(mrope_section=[8, 12, 12], mrope_interleaved=1)
    assert str(e.value) == "rope_pool_fused: mrope_interleaved must be a bool, got int"


def test_the_axis_maps_of_qwen2_5_vl_and_qwen3_vl():
    assert mrope_axes(64, [16, 24, 24], False).tolist() == [0] * 16 + [1] * 24 + [2] * 24
    assert mrope_axes(64, [24, 20, 20], True).tolist() == [0, 1, 2] * 20 + [0] * 4


def vl_positions(T, table_rows, device="cuda", seed=0):
    """[3, T] as a VL prompt has them: text tokens with three equal positions,
    an image's tokens on a grid (time fixed, height and width vary)."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, table_rows, (3, T), generator=g)
    pos[:, : T // 3] = pos[0, : T // 3]  # text
    return pos.to(device)


def case(T, dtype, hq=8, hkv=2, D=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(T, h, D, device="cuda", dtype=dtype, generator=g) for h in (hq, hkv, hkv))


def pools_of(n, *shape, dtype):
    return [torch.full(shape, float("nan"), device="cuda", dtype=dtype) for _ in range(n)]


def same_bits(got, want):
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@CUDA
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "qk_norm"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["sections", "interleaved"])
@pytest.mark.parametrize("T", [1, 17, 1100])
def test_bit_for_bit_the_gathered_rows(dtype, table_dtype, is_neox, norm, interleaved, T):
    q, k, v = case(T, dtype)
    section = [24, 20, 20] if interleaved else [16, 24, 24]
    table = attnprep.rope_cos_sin_cache(128, 3000, 1e6, dtype=table_dtype, device="cuda")
    positions = vl_positions(T, 3000)
    rows = mrope_cos_sin_rows(table, positions, section, interleaved)
    slots = torch.randperm(4 * T, device="cuda")[:T]
    kw = dict(head_dim=128, num_qo_heads=8, num_kv_heads=2, rope_base=1e6, is_neox=is_neox)
    if norm:
        kw.update(
            q_norm_weight=torch.rand(128, device="cuda") + 0.5, k_norm_weight=torch.rand(128, device="cuda") + 0.5
        )
    pools = pools_of(4, 4 * T, 2, 128, dtype=dtype)
    want = attnprep.rope_pool_fused(q, k, v, None, slots, pools[0], pools[1], cos_sin_cache=rows, **kw)
    got = attnprep.rope_pool_fused(
        q,
        k,
        v,
        positions,
        slots,
        pools[2],
        pools[3],
        cos_sin_cache=table,
        mrope_section=section,
        mrope_interleaved=interleaved,
        **kw,
    )
    same_bits(got, want)


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["sections", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [128, 64])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_rope_base_against_float64(dtype, interleaved, rotary_dim, is_neox):
    T, half = 65, rotary_dim // 2
    section = [half // 4, 3 * half // 8, half - half // 4 - 3 * half // 8]
    q, k, v = case(T, dtype)
    positions = vl_positions(T, 1 << 20, seed=3)
    axis_cs = [cos_sin(positions[a], rotary_dim, base=1e6) for a in range(3)]
    axes = mrope_axes(half, section, interleaved)
    i = torch.arange(half)
    cos = torch.stack([c for c, _ in axis_cs])[axes, :, i].t()
    sin = torch.stack([s for _, s in axis_cs])[axes, :, i].t()
    slots = torch.arange(T, device="cuda")
    k_pool, v_pool = pools_of(2, T, 2, 128, dtype=dtype)
    q_rot, k_rot, _, _ = attnprep.rope_pool_fused(
        q,
        k,
        v,
        positions,
        slots,
        k_pool,
        v_pool,
        head_dim=128,
        num_qo_heads=8,
        num_kv_heads=2,
        rope_base=1e6,
        rotary_dim=rotary_dim,
        is_neox=is_neox,
        mrope_section=section,
        mrope_interleaved=interleaved,
    )
    for got, x in ((q_rot, q), (k_rot, k)):
        assert rope_error_ratio(got, rope_reference(x, cos, sin, rotary_dim, is_neox), x, rotary_dim, is_neox) <= 1
    assert torch.equal(k_pool, k_rot) and torch.equal(v_pool, v)


@CUDA
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_strided_positions_and_slots(index_dtype):
    """Positions as a column of a batch's [B, S] ids, [3, B, S] M-RoPE ids, slots every other entry."""
    T = 37
    q, k, v = case(T, torch.bfloat16)
    table = attnprep.rope_cos_sin_cache(128, 500, 1e4, device="cuda")
    kw = dict(head_dim=128, num_qo_heads=8, num_kv_heads=2, rope_base=1e4, cos_sin_cache=table)
    ids = torch.randint(0, 500, (T, 5), device="cuda", dtype=index_dtype)
    slot_buf = torch.randperm(2 * T, device="cuda").to(index_dtype)
    pools = pools_of(4, 2 * T, 2, 128, dtype=torch.bfloat16)
    want = attnprep.rope_pool_fused(q, k, v, ids[:, 3].contiguous(), slot_buf[::2].contiguous(), *pools[:2], **kw)
    got = attnprep.rope_pool_fused(q, k, v, ids[:, 3], slot_buf[::2], *pools[2:], **kw)
    same_bits(got, want)
    mrope_ids = torch.randint(0, 500, (3, 2, T), device="cuda", dtype=index_dtype)[:, 1]  # [3, T] of [3, B, S]
    section = dict(mrope_section=[16, 24, 24])
    pools = pools_of(4, 2 * T, 2, 128, dtype=torch.bfloat16)
    want = attnprep.rope_pool_fused(q, k, v, mrope_ids.contiguous(), slot_buf[:T], *pools[:2], **kw, **section)
    got = attnprep.rope_pool_fused(q, k, v, mrope_ids, slot_buf[:T], *pools[2:], **kw, **section)
    same_bits(got, want)


@CUDA
def test_a_position_outside_the_table_on_any_axis():
    T = 9
    q, k, v = case(T, torch.bfloat16)
    table = attnprep.rope_cos_sin_cache(128, 100, 1e4, device="cuda")
    positions = torch.randint(0, 100, (3, T), device="cuda")
    positions[2, 4] = 100  # width of token 4
    positions[1, 6] = -1  # height of token 6
    k_pool, v_pool = (torch.zeros(T, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kw = dict(head_dim=128, num_qo_heads=8, num_kv_heads=2, rope_base=1e4, cos_sin_cache=table)
    slots = torch.arange(T, device="cuda")
    q_rot, k_rot, _, _ = attnprep.rope_pool_fused(
        q, k, v, positions, slots, k_pool, v_pool, mrope_section=[16, 24, 24], **kw
    )
    bad = torch.zeros(T, dtype=torch.bool)
    bad[[4, 6]] = True
    assert torch.isnan(q_rot[bad]).all() and torch.isnan(k_rot[bad]).all()
    assert not torch.isnan(q_rot[~bad]).any()
    assert (k_pool[bad] == 0).all() and (v_pool[bad] == 0).all() and torch.equal(v_pool[~bad], v[~bad])
    with pytest.raises(ValueError) as e:
        attnprep.rope_pool_fused(
            q, k, v, positions, slots, k_pool, v_pool, mrope_section=[16, 24, 24], check_slots=True, **kw
        )
    assert str(e.value) == "positions must be in [0, cos_sin_cache.shape[0])"


@CUDA
def test_fp8_paged_pools_graphs_and_compile():
    T = 33
    q, k, v = case(T, torch.bfloat16)
    table = attnprep.rope_cos_sin_cache(128, 64, 1e6, device="cuda")
    positions = vl_positions(T, 64, seed=7)
    section = [24, 20, 20]
    rows = mrope_cos_sin_rows(table, positions, section, True)
    slots = torch.randperm(256, device="cuda")[:T]
    scale = torch.tensor(0.5, device="cuda")
    kw = dict(head_dim=128, num_qo_heads=8, num_kv_heads=2, rope_base=1e6, k_scale=scale, v_scale=scale)
    mk = dict(mrope_section=section, mrope_interleaved=True, cos_sin_cache=table)
    pools = [torch.zeros(16, 2, 16, 128, device="cuda", dtype=torch.float8_e4m3fn) for _ in range(4)]
    want = attnprep.rope_pool_fused(q, k, v, None, slots, pools[0], pools[1], cos_sin_cache=rows, kv_layout="HND", **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = attnprep.rope_pool_fused(q, k, v, positions, slots, pools[2], pools[3], kv_layout="HND", **mk, **kw)
    graph.replay()
    torch.cuda.synchronize()
    same_bits(got, want)
    compiled = torch.compile(
        lambda q, k, v: attnprep.rope_pool_fused(
            q, k, v, positions, slots, pools[2], pools[3], kv_layout="HND", **mk, **kw
        ),
        fullgraph=True,
    )
    q_rot, k_rot, _, _ = compiled(q, k, v)
    assert torch.equal(q_rot, want[0]) and torch.equal(k_rot, want[1])


@CUDA
def test_opcheck():
    T = 9
    q, k, v = case(T, torch.float16, D=64)
    table = attnprep.rope_cos_sin_cache(64, 50, 1e4, device="cuda")
    positions = vl_positions(T, 50, seed=11)
    slots = torch.randperm(21, device="cuda")[:T]
    pools = [torch.zeros(21, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2)]
    mrope = dict(cos_sin_cache=table, mrope_section=[8, 12, 12], mrope_interleaved=True)
    args = rope_schema_args(q, k, v, positions, slots, *pools, **mrope)
    torch.library.opcheck(torch.ops.attnprep.rope_pool_fused.default, args)
