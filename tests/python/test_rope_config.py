"""rope_kwargs_from_config against transformers' own models: the geometry of
their attention layers and the cos/sin of their own rotary embeddings (float32,
bit for bit), for every family it knows; clear errors for the configs it does
not understand."""

import pytest
import torch
from attnprep import rope_kwargs_from_config

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=128, intermediate_size=64, num_hidden_layers=2, vocab_size=100, max_position_embeddings=4096)
GQA = dict(SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + i / 16 for i in range(16)],
    "long_factor": [2.0 + i / 8 for i in range(16)],
}

# family: (model class, config, where its rotary embedding is, expected extras)
MODELS = {
    "llama3": (transformers.LlamaForCausalLM, lambda: transformers.LlamaConfig(**GQA, rope_parameters=LLAMA3)),
    "llama-yarn": (transformers.LlamaForCausalLM, lambda: transformers.LlamaConfig(**GQA, rope_parameters=YARN)),
    "mistral": (transformers.MistralForCausalLM, lambda: transformers.MistralConfig(**GQA)),
    "qwen2": (
        transformers.Qwen2ForCausalLM,
        lambda: transformers.Qwen2Config(**{k: v for k, v in GQA.items() if k != "head_dim"}),
    ),
    "qwen3": (transformers.Qwen3ForCausalLM, lambda: transformers.Qwen3Config(**GQA)),
    "gpt_neox": (
        transformers.GPTNeoXForCausalLM,
        lambda: transformers.GPTNeoXConfig(**dict(SMALL, num_attention_heads=4), rotary_pct=0.25),
    ),
    "phi3-longrope": (
        transformers.Phi3ForCausalLM,
        lambda: transformers.Phi3Config(
            **dict(SMALL, num_attention_heads=4, num_key_value_heads=4),
            pad_token_id=0,
            original_max_position_embeddings=1024,
            rope_parameters=LONGROPE,
        ),
    ),
}


def model_cos_sin(model, positions, layer_type=None):
    """cos and sin [T, rotary_dim / 2] as the model's own rotary embedding gives them."""
    inner = getattr(model, "model", None) or getattr(model, "gpt_neox", None) or model.transformer
    x = torch.zeros(1, positions.numel(), model.config.hidden_size)
    args = (x, positions[None]) + ((layer_type,) if layer_type else ())
    a, b = inner.rotary_emb(*args)
    if model.config.model_type == "gptj":  # (sin, cos), each of rotary_dim / 2
        return b[0], a[0]
    half = a.shape[-1] // 2  # NeoX: each half repeated
    return a[0, :, :half], b[0, :, :half]


def attention_of(model, layer=0):
    inner = getattr(model, "model", None) or getattr(model, "gpt_neox", None) or model.transformer
    layers = getattr(inner, "layers", None) or getattr(inner, "h", None)
    block = layers[layer]
    return getattr(block, "self_attn", None) or getattr(block, "attention", None) or block.attn


@pytest.mark.parametrize("family", MODELS)
def test_the_model_rotary_embedding_bit_for_bit(family):
    cls, make = MODELS[family]
    config = make()
    model = cls(config).eval()
    kw = rope_kwargs_from_config(config)
    tc = config
    assert kw["num_qo_heads"] == tc.num_attention_heads
    assert kw["num_kv_heads"] == (getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads)
    attention = attention_of(model)
    assert kw["head_dim"] == (getattr(attention, "head_dim", None) or attention.head_size)
    positions = torch.tensor([0, 1, 7, 1023, 1024, 2047, 4095])
    if family == "phi3-longrope":  # the model takes its long factors past the original context
        positions = torch.tensor([1024, 2047, 4095])
    cos, sin = model_cos_sin(model, positions)
    half = kw["rotary_dim"] // 2
    assert cos.shape[-1] == half
    table = kw["cos_sin_cache"][positions]
    assert torch.equal(table[:, :half], cos) and torch.equal(table[:, half:], sin)
    assert kw["is_neox"] is True
    if family == "qwen3":
        assert (kw["norm_eps"], kw["norm_weight_offset"]) == (config.rms_norm_eps, 0.0)
    else:
        assert "norm_eps" not in kw


def test_longrope_short_factors_for_short_sequences():
    cls, make = MODELS["phi3-longrope"]
    config = make()
    model = cls(config).eval()
    kw = rope_kwargs_from_config(config, max_position=1024, seq_len=1024)
    positions = torch.tensor([0, 5, 1023])
    cos, sin = model_cos_sin(model, positions)
    assert torch.equal(kw["cos_sin_cache"][positions], torch.cat([cos, sin], -1))


def test_gptj_pairs_over_its_rotary_dim():
    config = transformers.GPTJConfig(n_embd=128, n_head=4, rotary_dim=16, n_layer=1, vocab_size=100, n_positions=512)
    model = transformers.GPTJForCausalLM(config).eval()
    kw = rope_kwargs_from_config(config)
    assert (kw["head_dim"], kw["rotary_dim"], kw["is_neox"], kw["num_kv_heads"]) == (32, 16, False, 4)
    positions = torch.tensor([0, 3, 511])
    cos, sin = model_cos_sin(model, positions)
    assert torch.equal(kw["cos_sin_cache"][positions], torch.cat([cos, sin], -1))


def test_gemma3_layers_by_type():
    config = transformers.Gemma3TextConfig(**GQA, sliding_window=16)
    model = transformers.Gemma3ForCausalLM(config).eval()
    positions = torch.tensor([0, 9, 4095])
    for layer, layer_type in enumerate(config.layer_types):
        kw = rope_kwargs_from_config(config, layer)
        cos, sin = model_cos_sin(model, positions, layer_type)
        assert torch.equal(kw["cos_sin_cache"][positions], torch.cat([cos, sin], -1))
        assert kw["rope_base"] == config.rope_parameters[layer_type]["rope_theta"]
        assert (kw["norm_eps"], kw["norm_weight_offset"]) == (config.rms_norm_eps, 1.0)
        assert kw["head_dim"] == attention_of(model, layer).head_dim


def test_what_it_does_not_understand_is_named():
    def message(config, *args):
        with pytest.raises(ValueError) as e:
            rope_kwargs_from_config(config, *args)
        return str(e.value)

    gemma = transformers.Gemma3TextConfig(**GQA, sliding_window=16)
    assert message(gemma) == (
        "rope_kwargs_from_config: the layers of model type gemma3_text differ in their RoPE "
        "(full_attention, sliding_attention); pass layer_idx"
    )
    assert message(gemma, 2) == "rope_kwargs_from_config: layer_idx must be in [0, 2), got 2"
    assert message(transformers.BertConfig()) == (
        "rope_kwargs_from_config: model type bert is not one it knows "
        "(llama, mistral, qwen2, qwen3, qwen3_moe, gemma3_text, gpt_neox, gptj, phi3, qwen2_vl_text, "
        "qwen2_5_vl_text, qwen3_vl_text, qwen3_vl_moe_text)"
    )
    sections = transformers.LlamaConfig(**GQA)
    sections.rope_parameters = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 6, 6]}
    assert message(sections) == (
        "rope_kwargs_from_config: model type llama does not rotate with M-RoPE, yet its RoPE has mrope_section"
    )
    odd = transformers.LlamaConfig(**GQA)
    odd.rope_parameters = {"rope_type": "ntk-by-parts", "rope_theta": 10000.0}
    assert message(odd) == (
        "rope_kwargs_from_config: rope type ntk-by-parts is not one it knows "
        "(default, linear, yarn, llama3, dynamic, longrope)"
    )
    odd.rope_parameters = {"rope_type": "default"}
    assert message(odd) == "rope_kwargs_from_config: the RoPE parameters have no rope_theta"
    gptj = transformers.GPTJConfig(rotary_dim=8)
    gptj.__dict__["rotary_dim"] = None  # transformers' own validation refuses it; a hand-made config may not
    assert message(gptj) == ("rope_kwargs_from_config: a gptj config without rotary_dim is not one it knows")


VL_TEXT = dict(SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=128)


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("given", [False, True], ids=["model_default", "config_section"])
def test_vl_models_their_sections_and_their_rotary_embedding(kind, given):
    """The text model's own rotary embedding (M-RoPE recomposed), bit for bit,
    at VL positions (text, then an image's grid): rows of the table gathered
    by mrope_axes from the kwargs' sections."""
    from attnprep.testing import mrope_cos_sin_rows

    section = [8, 28, 28] if kind == "qwen2_5_vl" else [16, 24, 24]
    rope = {"rope_type": "default", "rope_theta": 1e6, **({"mrope_section": section} if given else {})}
    if kind == "qwen2_5_vl":
        config = transformers.Qwen2_5_VLConfig(text_config=dict(VL_TEXT, rope_parameters=rope))
        module = transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLRotaryEmbedding
        want = (section if given else [16, 24, 24], False)
    else:
        config = transformers.Qwen3VLConfig(text_config=dict(VL_TEXT, rope_parameters=rope))
        module = transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLTextRotaryEmbedding
        want = (section if given else [24, 20, 20], True)
    kw = rope_kwargs_from_config(config)
    assert (kw["mrope_section"], kw["mrope_interleaved"]) == want
    assert (kw["head_dim"], kw["num_qo_heads"], kw["num_kv_heads"], kw["rotary_dim"]) == (128, 4, 2, 128)
    assert ("norm_weight_offset" in kw) == (kind == "qwen3_vl")
    positions = torch.tensor([[0, 1, 2, 3, 3, 3, 3, 9], [0, 1, 2, 3, 3, 4, 4, 9], [0, 1, 2, 3, 4, 3, 4, 9]])
    cos, sin = module(config.get_text_config())(torch.zeros(1, 8, 128), positions[:, None])
    rows = mrope_cos_sin_rows(kw["cos_sin_cache"], positions, *want)
    assert torch.equal(rows[:, :64], cos[0, :, :64]) and torch.equal(rows[:, 64:], sin[0, :, :64])
