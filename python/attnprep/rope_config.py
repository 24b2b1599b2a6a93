"""rope_kwargs_from_config: a transformers config -> rope_pool_fused's keyword arguments."""

from __future__ import annotations

from typing import Optional

import torch

from .rope_tables import rope_cos_sin_cache

_OP = "rope_kwargs_from_config"

# Model types it knows, by their text config's model_type: how each rotates
# (NeoX halves or GPT-J pairs) and the per-head QK norm it runs (None: none;
# else the norm_weight_offset of its RMSNorm: 0 as Qwen3 writes it, 1 Gemma's).
_FAMILIES = {
    "llama": (True, None),
    "mistral": (True, None),
    "qwen2": (True, None),
    "qwen3": (True, 0.0),
    "qwen3_moe": (True, 0.0),
    "gemma3_text": (True, 1.0),
    "gpt_neox": (True, None),
    "gptj": (False, None),
    "phi3": (True, None),
    "qwen2_vl_text": (True, None),
    "qwen2_5_vl_text": (True, None),
    "qwen3_vl_text": (True, 0.0),
    "qwen3_vl_moe_text": (True, 0.0),
}
# M-RoPE model types: the sections their rotary embedding takes where the RoPE dict has none, and whether it
# interleaves them (Qwen3-VL's code always does, whatever the dict says).
_MROPE = {
    "qwen2_vl_text": ([16, 24, 24], False),
    "qwen2_5_vl_text": ([16, 24, 24], False),
    "qwen3_vl_text": ([24, 20, 20], True),
    "qwen3_vl_moe_text": ([24, 20, 20], True),
}
# Schemes whose table is fixed by the config; "dynamic" and "longrope" adapt
# to the sequence length (``seq_len`` picks it).
_STATIC = ("default", "linear", "yarn", "llama3")
_ADAPTIVE = ("dynamic", "longrope")
# Keys of a RoPE dict that carry no scheme parameter
_NOT_SCALING = ("rope_theta", "rope_type", "type", "partial_rotary_factor", "mrope_section", "mrope_interleaved")


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _rope_parameters(tc, layer_idx: Optional[int]) -> dict:
    """The layer's RoPE dict (transformers >= 5's rope_parameters, per layer type where layers differ)."""
    params = getattr(tc, "rope_parameters", None)
    if params is None:
        raise ValueError(f"{_OP}: the config of model type {tc.model_type} has no rope_parameters")
    types = getattr(tc, "layer_types", None)
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type
        if layer_idx is None:
            raise ValueError(
                f"{_OP}: the layers of model type {tc.model_type} differ in their RoPE "
                f"({', '.join(sorted(params))}); pass layer_idx"
            )
        if types is None or not (isinstance(layer_idx, int) and 0 <= layer_idx < len(types)):
            raise ValueError(f"{_OP}: layer_idx must be in [0, {len(types or [])}), got {layer_idx}")
        if types[layer_idx] not in params:
            raise ValueError(f"{_OP}: no RoPE parameters for layer type {types[layer_idx]}")
        params = params[types[layer_idx]]
    return dict(params)


def rope_kwargs_from_config(
    config,
    layer_idx: Optional[int] = None,
    *,
    max_position: Optional[int] = None,
    seq_len: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> dict:
    """The keyword arguments of :func:`rope_pool_fused` for a transformers model.

    Reads the model's geometry, its rotation style and its RoPE scheme from
    its config and builds the model's own table with
    :func:`rope_cos_sin_cache`. A config it does not understand (another
    model type, a RoPE type or key it does not know) raises a ValueError
    naming what it did not understand; nothing is guessed.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config (a multimodal config's text config is used).
        Model types: llama, mistral, qwen2, qwen3, qwen3_moe, gemma3_text,
        gpt_neox, gptj, phi3, and the text models of Qwen2-VL, Qwen2.5-VL,
        Qwen3-VL and Qwen3-VL-MoE (M-RoPE).
    layer_idx : int, optional
        The layer, where layers differ in their RoPE (Gemma 3's sliding and
        global layers).
    max_position : int, optional
        Rows of the table (default: the config's ``max_position_embeddings``).
    seq_len : int, optional
        The sequence length the ``dynamic`` and ``longrope`` schemes adapt to
        (default ``max_position``; LongRoPE takes its short factors up to the
        original context).
    dtype : torch.dtype
        The table's dtype, float32 (default) or bfloat16.
    device : torch.device or str, optional
        Where the table is built.

    Returns
    -------
    dict
        ``head_dim``, ``num_qo_heads``, ``num_kv_heads``, ``rope_base``,
        ``rotary_dim``, ``is_neox``, ``cos_sin_cache``; for models with a
        per-head QK norm (Qwen3, Gemma 3) also ``norm_eps`` and
        ``norm_weight_offset`` (the weights are the layer's own
        ``q_norm.weight`` / ``k_norm.weight``); for M-RoPE models also
        ``mrope_section`` and ``mrope_interleaved`` (positions are then
        ``[3, T]``, e.g. from the model's ``get_rope_index``).

    Raises
    ------
    ValueError
        ``"rope_kwargs_from_config: ..."`` naming what it did not understand,
        or the messages of :func:`rope_cos_sin_cache`.

    Examples
    --------
    >>> import transformers
    >>> config = transformers.Qwen3Config(head_dim=128, num_attention_heads=32, num_key_value_heads=8)
    >>> kw = rope_kwargs_from_config(config)
    >>> kw["rotary_dim"], kw["is_neox"], kw["norm_weight_offset"], tuple(kw["cos_sin_cache"].shape)
    (128, True, 0.0, (32768, 128))
    """
    tc = _text_config(config)
    kind = getattr(tc, "model_type", None)
    if kind not in _FAMILIES:
        raise ValueError(f"{_OP}: model type {kind} is not one it knows ({', '.join(_FAMILIES)})")
    is_neox, norm_offset = _FAMILIES[kind]
    heads = tc.num_attention_heads
    kv_heads = getattr(tc, "num_key_value_heads", None) or heads
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
    max_position = max_position or tc.max_position_embeddings
    if kind == "gptj":  # no RoPE dict: plain RoPE, base 10000, over the first rotary_dim elements
        if not tc.rotary_dim:  # the model then rotates with frequencies over its hidden size, not a head's
            raise ValueError(f"{_OP}: a gptj config without rotary_dim is not one it knows")
        params = {"rope_type": "default", "rope_theta": 10000.0}
        rotary_dim = tc.rotary_dim
    else:
        params = _rope_parameters(tc, layer_idx)
        rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if kind not in _MROPE and ("mrope_section" in params or "mrope_interleaved" in params):
        raise ValueError(f"{_OP}: model type {kind} does not rotate with M-RoPE, yet its RoPE has mrope_section")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _STATIC + _ADAPTIVE:
        raise ValueError(f"{_OP}: rope type {rope_type} is not one it knows ({', '.join(_STATIC + _ADAPTIVE)})")
    if "rope_theta" not in params:
        raise ValueError(f"{_OP}: the RoPE parameters have no rope_theta")
    scaling = {k: v for k, v in params.items() if k not in _NOT_SCALING}
    scaling["rope_type"] = rope_type
    original = getattr(tc, "original_max_position_embeddings", None)
    if rope_type in ("longrope", "yarn") and "original_max_position_embeddings" not in scaling and original:
        scaling["original_max_position_embeddings"] = original  # Phi-3 keeps it on the config
    table = rope_cos_sin_cache(
        head_dim,
        max_position,
        params["rope_theta"],
        rotary_dim=rotary_dim,
        scaling=scaling,
        max_position_embeddings=tc.max_position_embeddings,
        seq_len=seq_len,
        dtype=dtype,
        device=device,
    )
    kwargs = dict(
        head_dim=head_dim,
        num_qo_heads=heads,
        num_kv_heads=kv_heads,
        rope_base=float(params["rope_theta"]),
        rotary_dim=rotary_dim,
        is_neox=is_neox,
        cos_sin_cache=table,
    )
    if norm_offset is not None:
        kwargs.update(norm_eps=float(tc.rms_norm_eps), norm_weight_offset=norm_offset)
    if kind in _MROPE:
        section, interleaved = _MROPE[kind]
        kwargs.update(mrope_section=list(params.get("mrope_section", section)), mrope_interleaved=interleaved)
    return kwargs
