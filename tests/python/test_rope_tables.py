"""rope_cos_sin_cache against transformers' own rotary embeddings (the code a
model runs), where transformers is importable, and against fixtures written
from it (make_rope_fixtures.py) everywhere; then the table in the kernel."""

import math
import os

import attnprep
import pytest
import torch
from rope_schemes import HEAD_DIM, MAX_POSITION, POSITIONS, SCHEMES

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "rope_tables.pt")


def ours(name, **kw):
    base, scaling, extra = SCHEMES[name]
    return attnprep.rope_cos_sin_cache(HEAD_DIM, MAX_POSITION, base, scaling=scaling, **extra, **kw)


def assert_float32_equal(got, want):
    """To float32 rounding: a few ulp of the values' scale (cos/sin of the
    same float32 angle; the schemes' frequency formulas are float32 too)."""
    scale = want.abs().amax().clamp(min=1.0)
    err = (got - want).abs().max().item()
    assert err <= 4 * 2.0**-24 * scale.item(), f"max error {err:.3g}"


@pytest.mark.parametrize("name", list(SCHEMES))
def test_matches_the_fixtures_from_transformers(name):
    saved = torch.load(FIXTURES)
    assert saved["positions"] == POSITIONS
    assert_float32_equal(ours(name)[POSITIONS], saved["tables"][name])


@pytest.mark.parametrize("name", list(SCHEMES))
def test_matches_transformers_at_every_position(name):
    pytest.importorskip("transformers")
    from rope_schemes import transformers_table

    assert_float32_equal(ours(name), transformers_table(name))


def test_bfloat16_and_device():
    t = attnprep.rope_cos_sin_cache(64, 10, 10000.0, dtype=torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.shape == (10, 64)
    assert torch.equal(t, attnprep.rope_cos_sin_cache(64, 10, 10000.0).bfloat16())


def test_partial_rotary():
    t = attnprep.rope_cos_sin_cache(128, 5, 10000.0, rotary_dim=32)
    assert t.shape == (5, 32)
    same = attnprep.rope_cos_sin_cache(128, 5, 10000.0, scaling={"partial_rotary_factor": 0.25})
    assert torch.equal(t, same)


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        (dict(scaling={"rope_type": "ntk-by-parts"}), "rope_cos_sin_cache: unknown rope scaling type ntk-by-parts"),
        (dict(scaling={"type": "linear"}), "rope_cos_sin_cache: linear scaling needs factor"),
        (
            dict(scaling={"rope_type": "dynamic", "factor": 2.0}),
            "rope_cos_sin_cache: dynamic scaling needs max_position_embeddings",
        ),
        (
            dict(scaling={"rope_type": "llama3", "factor": 8.0}),
            "rope_cos_sin_cache: llama3 scaling needs low_freq_factor",
        ),
        (
            dict(scaling={"rope_type": "yarn", "factor": 4.0}),
            "rope_cos_sin_cache: yarn scaling needs original_max_position_embeddings",
        ),
        (dict(rotary_dim=3), "rope_cos_sin_cache: rotary_dim must be even and in [2, head_dim], got 3"),
        (dict(rotary_dim=256), "rope_cos_sin_cache: rotary_dim must be even and in [2, head_dim], got 256"),
        (
            dict(dtype=torch.float16),
            "rope_cos_sin_cache: dtype must be torch.float32 or torch.bfloat16, got torch.float16",
        ),
    ],
)
def test_errors(kwargs, msg):
    with pytest.raises(ValueError) as e:
        attnprep.rope_cos_sin_cache(128, 16, 10000.0, **kwargs)
    assert str(e.value) == msg


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
LONGROPE = {
    "rope_type": "longrope",
    "original_max_position_embeddings": 4096,
    "long_factor": [1.5] * 64,
    "short_factor": [1.0] * 64,
    "factor": 8.0,
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def positive(name, value):
    return f"rope_cos_sin_cache: {name} must be a positive finite number, got {value!r}"


# Values for which the model's own formulas divide by zero, take the log of
# a non-positive number or return NaN: each its own message, no table.
@pytest.mark.parametrize(
    "base, kwargs, msg",
    [
        (0.0, {}, positive("base", 0.0)),
        (-10000.0, {}, positive("base", -10000.0)),
        (float("nan"), {}, positive("base", float("nan"))),
        (float("inf"), {}, positive("base", float("inf"))),
        (True, {}, positive("base", True)),
        ("10000", {}, positive("base", "10000")),
        (10000.0, dict(scaling="linear"), "rope_cos_sin_cache: scaling must be a dict or None, got str"),
        (10000.0, dict(scaling={"rope_type": "linear", "factor": 0}), positive("linear scaling's factor", 0)),
        (10000.0, dict(scaling={"rope_type": "linear", "factor": -4.0}), positive("linear scaling's factor", -4.0)),
        (10000.0, dict(scaling={"rope_type": "linear", "factor": "4"}), positive("linear scaling's factor", "4")),
        (
            10000.0,
            dict(scaling={"partial_rotary_factor": 0.0}),
            positive("default scaling's partial_rotary_factor", 0.0),
        ),
        (10**400, {}, positive("base", 10**400)),  # an int past float's range
        (
            10000.0,
            dict(scaling={"rope_type": "linear", "factor": -(10**400)}),
            positive("linear scaling's factor", -(10**400)),
        ),
        (
            10000.0,
            dict(scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=0),
            positive("max_position_embeddings", 0),
        ),
        (
            10000.0,
            dict(scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=4096, rotary_dim=2),
            "rope_cos_sin_cache: dynamic scaling needs rotary_dim >= 4, got 2",
        ),
        (
            10000.0,
            dict(scaling={**YARN, "original_max_position_embeddings": 0}),
            positive("yarn scaling's original_max_position_embeddings", 0),
        ),
        (10000.0, dict(scaling={**YARN, "factor": float("inf")}), positive("yarn scaling's factor", float("inf"))),
        (10000.0, dict(scaling={**YARN, "attention_factor": 0.0}), positive("yarn scaling's attention_factor", 0.0)),
        (
            10000.0,
            dict(scaling={**YARN, "mscale": -1.0, "mscale_all_dim": 1.0}),
            positive("yarn scaling's mscale", -1.0),
        ),
        (10000.0, dict(scaling={**YARN, "beta_slow": -1}), positive("yarn scaling's beta_slow", -1)),
        (1.0, dict(scaling=YARN), "rope_cos_sin_cache: yarn scaling needs base > 1, got 1.0"),
        (10000.0, dict(scaling={**LLAMA3, "high_freq_factor": 0}), positive("llama3 scaling's high_freq_factor", 0)),
        (
            10000.0,
            dict(scaling={**LONGROPE, "long_factor": [1.5] * 63}),
            "rope_cos_sin_cache: longrope scaling's long_factor must hold rotary_dim / 2 = 64 positive finite numbers",
        ),
        (
            10000.0,
            dict(scaling={**LONGROPE, "short_factor": [1.0] * 63 + [0.0]}),
            "rope_cos_sin_cache: longrope scaling's short_factor must hold rotary_dim / 2 = 64 positive finite numbers",
        ),
        (
            10000.0,
            dict(scaling={**LONGROPE, "original_max_position_embeddings": 1}),
            "rope_cos_sin_cache: longrope scaling needs original_max_position_embeddings > 1, got 1",
        ),
    ],
)
def test_values_the_formulas_cannot_take(base, kwargs, msg):
    with pytest.raises(ValueError) as e:
        attnprep.rope_cos_sin_cache(128, 16, base, **kwargs)
    assert str(e.value) == msg


def not_finite(inv, attention=1.0):
    return (
        f"rope_cos_sin_cache: the table would not be finite in float32 (position 15 * inv_freq {inv!r}, "
        f"attention factor {attention!r})"
    )


# Values each in range whose table still overflows float32 (the model's own code returns inf or NaN there).
@pytest.mark.parametrize(
    "base, kwargs, msg",
    [
        (1e-300, {}, not_finite(math.inf)),
        (10000.0, dict(scaling={"rope_type": "linear", "factor": 1e-300}), not_finite(math.inf)),
        (10000.0, dict(scaling={**YARN, "mscale": 1e308, "mscale_all_dim": 1.0}), None),
    ],
)
def test_tables_past_float32_are_refused(base, kwargs, msg):
    with pytest.raises(ValueError) as e:
        attnprep.rope_cos_sin_cache(128, 16, base, **kwargs)
    if msg is None:  # yarn's attention factor, (0.1 * 1e308 * ln 4 + 1) / (0.1 * ln 4 + 1), is past float32
        inv, attention = attnprep.rope_tables.rope_inv_freq(128, base, scaling=kwargs["scaling"])
        msg = not_finite(float(inv.max()), attention)
    assert str(e.value) == msg
    # the largest finite table still builds: base 1e-30 (inv_freq up to about 1e29, angles up to 1.4e30)
    assert torch.isfinite(attnprep.rope_cos_sin_cache(128, 16, 1e-30)).all()


def too_large(max_position, rotary_dim, dtype=torch.float32):
    return (
        f"rope_cos_sin_cache: the table would exceed 2^63 - 1 bytes ([max_position, rotary_dim] = "
        f"[{max_position}, {rotary_dim}] of {dtype})"
    )


@pytest.mark.parametrize(
    "head_dim, max_position, kwargs, msg",
    [
        (128, 2**56, {}, too_large(2**56, 128)),  # 2^65 bytes
        (128, 2**70, dict(dtype=torch.bfloat16), too_large(2**70, 128, torch.bfloat16)),
        (2**70, 1, {}, too_large(1, 2**70)),
        (2**70, 1, dict(rotary_dim=2**62), too_large(1, 2**62)),
        (2**70 + 3, 1, dict(scaling={"partial_rotary_factor": 0.5}), too_large(1, 2**69)),
        (
            2**70,
            1,
            dict(rotary_dim=2**70 + 1),
            f"rope_cos_sin_cache: rotary_dim must be even and in [2, head_dim], got {2**70 + 1}",
        ),  # the rotary_dim check comes first
        (2**70, 0, {}, "rope_cos_sin_cache: max_position must be positive, got 0"),
    ],
)
def test_tables_past_int64_bytes_are_refused(head_dim, max_position, kwargs, msg):
    """A table no tensor could hold gets its own message (before: an OverflowError or torch's
    storage-size error from inside the build)."""
    with pytest.raises(ValueError) as e:
        attnprep.rope_cos_sin_cache(head_dim, max_position, 10000.0, **kwargs)
    assert str(e.value) == msg


@pytest.mark.parametrize(
    "kwargs, name, kind",
    [
        (dict(head_dim=128.0), "head_dim", "float"),
        (dict(max_position=16.5), "max_position", "float"),
        (dict(max_position=True), "max_position", "bool"),
        (dict(rotary_dim="64"), "rotary_dim", "str"),
        (dict(seq_len=2.0), "seq_len", "float"),
    ],
)
def test_int_arguments_of_another_type(kwargs, name, kind):
    args = dict(head_dim=128, max_position=16, base=10000.0)
    args.update(kwargs)
    with pytest.raises(TypeError) as e:
        attnprep.rope_cos_sin_cache(args.pop("head_dim"), args.pop("max_position"), args.pop("base"), **args)
    assert str(e.value) == f"rope_cos_sin_cache: {name} must be an int, got {kind}"


def test_zero_means_the_default_where_the_model_reads_it_so():
    """yarn's beta_fast, beta_slow, mscale and mscale_all_dim: 0 is the
    default (the model's code reads them with ``or``), not an error."""
    zero = {**YARN, "beta_fast": 0, "beta_slow": 0, "mscale": 0, "mscale_all_dim": 0}
    default = {**YARN, "beta_fast": 32, "beta_slow": 1}
    assert torch.equal(
        attnprep.rope_cos_sin_cache(128, 64, 10000.0, scaling=zero),
        attnprep.rope_cos_sin_cache(128, 64, 10000.0, scaling=default),
    )
    with pytest.raises(ValueError) as e:
        attnprep.rope_cos_sin_cache(128, 0, 10000.0)
    assert str(e.value) == "rope_cos_sin_cache: max_position must be positive, got 0"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["llama3", "yarn_mscale", "longrope"])
def test_the_kernel_applies_the_table(name):
    from attnprep.testing import cos_sin, rope_error_ratio, rope_reference

    cache = ours(name, device="cuda")
    T = 65
    q = torch.randn(T, 8, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, 2, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    positions = torch.randint(0, MAX_POSITION, (T,), device="cuda")
    pools = [torch.zeros(T, 2, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    q_rot, k_rot, _, _ = attnprep.rope_pool_fused(
        q,
        k,
        k.clone(),
        positions,
        torch.arange(T, device="cuda"),
        *pools,
        head_dim=HEAD_DIM,
        num_qo_heads=8,
        num_kv_heads=2,
        rope_base=1.0,
        cos_sin_cache=cache,
    )
    cos, sin = cos_sin(positions, HEAD_DIM, cos_sin_cache=cache)
    assert rope_error_ratio(q_rot, rope_reference(q, cos, sin, HEAD_DIM, True), q, HEAD_DIM, True) <= 1
    assert rope_error_ratio(k_rot, rope_reference(k, cos, sin, HEAD_DIM, True), k, HEAD_DIM, True) <= 1


def test_deepseek_v3_yarn_table_bit_for_bit():
    """MLA's RoPE (issue: DeepSeek-V3 / Kimi K2): YaRN with DeepSeek's mscale over qk_rope_head_dim = 64, from
    the config as the model carries it, equal to DeepseekV3RotaryEmbedding's cos and sin to the bit."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    base, scaling, _ = SCHEMES["yarn_mscale"]  # DeepSeek-V3's: factor 40 over 4096, mscale 1 on all dims
    rope = dict(scaling, rope_theta=base)
    config = transformers.DeepseekV3Config(
        hidden_size=256,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=128,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        vocab_size=100,
        max_position_embeddings=163840,
        rope_parameters=rope,
    )
    positions = torch.tensor([0, 1, 17, 4095, 4096, 8191, 16383])
    cos, sin = DeepseekV3RotaryEmbedding(config)(torch.zeros(1, positions.numel(), 64), positions[None])
    table = attnprep.rope_cos_sin_cache(64, 16384, base, scaling=scaling, max_position_embeddings=163840)
    assert torch.equal(table[positions, :32], cos[0, :, :32]) and torch.equal(table[positions, 32:], sin[0, :, :32])
