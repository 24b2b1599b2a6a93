"""rope_cos_sin_cache against transformers' own rotary embeddings (the code a
model runs), where transformers is importable, and against fixtures written
from it (make_rope_fixtures.py) everywhere; then the table in the kernel."""

import os

import pytest
import torch

import attnprep
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


@pytest.mark.parametrize("kwargs, msg", [
    (dict(scaling={"rope_type": "ntk-by-parts"}), "rope_cos_sin_cache: unknown rope scaling type ntk-by-parts"),
    (dict(scaling={"type": "linear"}), "rope_cos_sin_cache: linear scaling needs factor"),
    (dict(scaling={"rope_type": "dynamic", "factor": 2.0}),
     "rope_cos_sin_cache: dynamic scaling needs max_position_embeddings"),
    (dict(scaling={"rope_type": "llama3", "factor": 8.0}), "rope_cos_sin_cache: llama3 scaling needs low_freq_factor"),
    (dict(scaling={"rope_type": "yarn", "factor": 4.0}),
     "rope_cos_sin_cache: yarn scaling needs original_max_position_embeddings"),
    (dict(rotary_dim=3), "rope_cos_sin_cache: rotary_dim must be even and in [2, head_dim], got 3"),
    (dict(rotary_dim=256), "rope_cos_sin_cache: rotary_dim must be even and in [2, head_dim], got 256"),
    (dict(dtype=torch.float16), "rope_cos_sin_cache: dtype must be torch.float32 or torch.bfloat16, got torch.float16"),
])
def test_errors(kwargs, msg):
    with pytest.raises(ValueError) as e:
        attnprep.rope_cos_sin_cache(128, 16, 10000.0, **kwargs)
    assert str(e.value) == msg
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
    q_rot, k_rot, _, _ = attnprep.rope_pool_fused(q, k, k.clone(), positions, torch.arange(T, device="cuda"), *pools,
                                                  head_dim=HEAD_DIM, num_qo_heads=8, num_kv_heads=2, rope_base=1.0,
                                                  cos_sin_cache=cache)
    cos, sin = cos_sin(positions, HEAD_DIM, cos_sin_cache=cache)
    assert rope_error_ratio(q_rot, rope_reference(q, cos, sin, HEAD_DIM, True), q, HEAD_DIM, True) <= 1
    assert rope_error_ratio(k_rot, rope_reference(k, cos, sin, HEAD_DIM, True), k, HEAD_DIM, True) <= 1
