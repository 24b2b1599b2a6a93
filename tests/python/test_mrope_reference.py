"""M-RoPE's reference (attnprep.testing.mrope_cos_sin_rows) against
transformers' own rotary embeddings of Qwen2.5-VL (contiguous sections) and
Qwen3-VL (interleaved sections): the per-token cos/sin rows bit for bit, for
time/height/width positions as an image prompt has them."""

import pytest
import torch
from attnprep import rope_cos_sin_cache
from attnprep.testing import mrope_axes, mrope_cos_sin_rows

transformers = pytest.importorskip("transformers")


def vl_positions(T, seed=0):
    """[3, T]: text tokens (all axes alike), then a 4 x 6 image grid, then text again."""
    g = torch.Generator().manual_seed(seed)
    start = int(torch.randint(0, 50, (1,), generator=g))
    text = torch.arange(start, start + 5)
    t, h, w = torch.meshgrid(torch.zeros(1, dtype=torch.long), torch.arange(4), torch.arange(6), indexing="ij")
    image = torch.stack([t.flatten(), h.flatten(), w.flatten()]) + start + 5
    tail = torch.arange(T - 29) + int(image.max()) + 1
    return torch.cat([text.expand(3, -1), image, tail.expand(3, -1)], dim=1)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_rows_equal_the_model_rotary_embedding(family):
    if family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding as Rotary

        section, interleaved = [16, 24, 24], False
        config = transformers.Qwen2_5_VLConfig(
            hidden_size=512,
            num_attention_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": section},
        ).get_text_config()
    else:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding as Rotary

        section, interleaved = [24, 20, 20], True
        config = transformers.Qwen3VLConfig().get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert head_dim == 128
    positions = vl_positions(40)
    cos, sin = Rotary(config)(torch.zeros(1, 40, head_dim), positions[:, None, :])
    theta = config.rope_parameters["rope_theta"]
    table = rope_cos_sin_cache(head_dim, 200, theta)
    rows = mrope_cos_sin_rows(table, positions, section, interleaved)
    assert torch.equal(rows, torch.cat([cos[0, :, :64], sin[0, :, :64]], dim=1))


def test_axes():
    assert mrope_axes(6, [2, 2, 2], False).tolist() == [0, 0, 1, 1, 2, 2]
    assert mrope_axes(6, [2, 2, 2], True).tolist() == [0, 1, 2, 0, 1, 2]
    assert mrope_axes(8, [4, 2, 2], True).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    with pytest.raises(ValueError) as e:
        mrope_axes(8, [2, 2, 2], False)
    assert str(e.value) == "mrope_section must sum to rotary_dim / 2 = 8, got [2, 2, 2]"
