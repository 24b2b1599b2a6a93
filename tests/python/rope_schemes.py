"""The RoPE scaling configurations the table tests use, as model configs
carry them, and the reference: transformers' own rotary embedding module
(the code a model runs). Shared by tests/python/test_rope_tables.py and the
script that writes the CI fixtures (make_rope_fixtures.py)."""

import torch

HEAD_DIM = 128
MAX_POSITION = 40000
# positions where the schemes differ most: small, around the original
# context lengths, and far past them
POSITIONS = [0, 1, 2, 17, 1000, 4095, 4096, 8191, 8192, 16384, 32767, 39999]

SCHEMES = {
    "default": (10000.0, None, {}),
    "linear": (10000.0, {"rope_type": "linear", "factor": 4.0}, {}),
    "dynamic": (10000.0, {"rope_type": "dynamic", "factor": 2.0}, {"max_position_embeddings": 4096}),
    "yarn": (
        10000.0,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192, "beta_fast": 32, "beta_slow": 1},
        {},
    ),
    "yarn_mscale": (
        10000.0,
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        {},
    ),
    "llama3": (
        500000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {},
    ),
    "longrope": (
        10000.0,
        {
            "rope_type": "longrope",
            "original_max_position_embeddings": 4096,
            "long_factor": [1.0 + 0.05 * i for i in range(64)],
            "short_factor": [1.0 + 0.01 * i for i in range(64)],
        },
        {"max_position_embeddings": 131072},
    ),
}


def transformers_table(name):
    """[MAX_POSITION, HEAD_DIM] cos half | sin half, from the model's own module."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    base, scaling, extra = SCHEMES[name]
    params = {"rope_type": "default", **(scaling or {}), "rope_theta": base}
    config = LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=extra.get("max_position_embeddings", MAX_POSITION),
        rope_parameters=params,
    )
    rotary = LlamaRotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, torch.arange(MAX_POSITION)[None])
    half = HEAD_DIM // 2
    return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=1)
