"""attnprep's Ulysses layer inside diffusers' context parallelism.

``enable_ulysses()`` makes diffusers' native attention backend run its
Ulysses exchange (``ContextParallelConfig(ulysses_degree=W)``, ring degree 1)
through :func:`attnprep.ulysses.ulysses_attention`: one exchange each way
instead of three in and one out, uneven rows and head counts padded and
masked, a key-padding mask agreed on by every rank first. Everything else
(sharding the model's inputs, gathering its outputs, other backends, ring
attention, lse, dropout, masks other than a key mask) stays diffusers' own.

Sequences the world size does not divide go through diffusers' own
``ulysses_anything=True`` sharding (ranks a row apart); the layer pads and
masks them.

Relies on diffusers' internals: the registry of attention backends
(``attention_dispatch._AttentionBackendRegistry``, whose NATIVE entry is
wrapped with the same parameters) and ``ContextParallelConfig``'s
``ulysses_degree``, ``ring_degree`` and ``_ulysses_mesh``. Tested with
diffusers 0.42; another release raises ``RuntimeError`` unless
``allow_untested=True``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..ulysses import sdpa_batched, ulysses_attention

TESTED = ((0, 42),)


def _version() -> tuple:
    from importlib.metadata import version

    return tuple(int(x) for x in version("diffusers").split(".")[:2])


def _key_padding_mask(attn_mask: Optional[torch.Tensor], query: torch.Tensor):
    """A boolean key mask of this rank's rows as ``[B, rows]``, None for no mask,
    or False where the mask is of another kind (left to diffusers)."""
    if attn_mask is None:
        return None
    if attn_mask.dtype != torch.bool:
        return False
    mask = attn_mask
    if mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1:
        mask = mask[:, 0, 0]
    return mask if mask.dim() == 2 and mask.shape == query.shape[:2] else False


def _require_tested(allow_untested: bool, call: str) -> None:
    if _version() not in TESTED and not allow_untested:
        raise RuntimeError(
            f"attnprep.integrations.diffusers: tested with diffusers {', '.join('%d.%d' % v for v in TESTED)}, "
            f"found {'.'.join(map(str, _version()))} ({call}(allow_untested=True) to try it)"
        )


def fuse_send_side(
    model: torch.nn.Module, group=None, allow_untested: bool = False, *, transport: str = "nccl", wire_dtype=None
) -> int:
    """Give ``model``'s Wan and Flux attention modules processors whose Ulysses send side is attnprep's (the QK
    norm and RoPE as the layer's ``prologue``, one qk_norm_rope pass); returns how many modules got one.
    ``group``: the Ulysses group where diffusers' context parallelism does not name one (default: its ulysses
    mesh); ``transport``, ``wire_dtype``: the layer's."""
    _require_tested(allow_untested, "fuse_send_side")
    from . import diffusers_send

    return diffusers_send.install(model, group, dict(transport=transport, wire_dtype=wire_dtype))


# The layer's options for every call enable_ulysses routes (its latest call's).
_OPTIONS = {"transport": "nccl", "wire_dtype": None}


def enable_ulysses(allow_untested: bool = False, *, transport: str = "nccl", wire_dtype=None) -> None:
    """Route diffusers' native Ulysses attention through attnprep (idempotent; the latest call's ``transport``
    and ``wire_dtype`` apply, as :func:`attnprep.ulysses.ulysses_attention` takes them)."""
    _require_tested(allow_untested, "enable_ulysses")
    from diffusers.models import attention_dispatch as ad

    _OPTIONS.update(transport=transport, wire_dtype=wire_dtype)
    registry, name = ad._AttentionBackendRegistry, ad.AttentionBackendName.NATIVE
    original = registry._backends[name]
    if getattr(original, "attnprep_original", None) is not None:
        return

    def native(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
        return_lse=False,
        _parallel_config=None,
    ):
        cp = _parallel_config.context_parallel_config if _parallel_config is not None else None
        mask = _key_padding_mask(attn_mask, query)
        ours = (
            cp is not None
            and cp.ulysses_degree > 1
            and cp.ring_degree == 1
            and not return_lse
            and dropout_p == 0.0
            and mask is not False
        )
        if not ours:
            return original(
                query,
                key,
                value,
                attn_mask,
                dropout_p,
                is_causal,
                scale,
                enable_gqa,
                return_lse,
                _parallel_config=_parallel_config,
            )
        group = cp._ulysses_mesh.get_group()
        attn_fn = sdpa_batched(is_causal, scale)
        return ulysses_attention(query, key, value, group=group, attn_fn=attn_fn, key_padding_mask=mask, **_OPTIONS)

    native.attnprep_original = original
    registry._backends[name] = native


def disable_ulysses() -> None:
    """Give diffusers its native backend back."""
    from diffusers.models import attention_dispatch as ad

    registry, name = ad._AttentionBackendRegistry, ad.AttentionBackendName.NATIVE
    original = getattr(registry._backends[name], "attnprep_original", None)
    if original is not None:
        registry._backends[name] = original
