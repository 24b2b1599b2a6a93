"""rope_pool_fused: RoPE on q and k plus the KV-pool write, in one launch."""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from . import _C
from ._dispatch import direct

Tensor = torch.Tensor

# Read once, at import: a per-call environment lookup would cost more than
# the launch of a small call.
_CHECK_SLOTS_ENV = os.environ.get("ATTNPREP_CHECK_SLOTS", "0") not in ("", "0")


@torch.library.custom_op("attnprep::rope_pool_fused", mutates_args=("k_pool", "v_pool"))
def _rope(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, slots: Tensor, k_pool: Tensor, v_pool: Tensor,
          head_dim: int, num_qo_heads: int, num_kv_heads: int, rope_base: float, rotary_dim: int, is_neox: bool,
          cos_sin_cache: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    q_rot, k_rot, _, _ = _C.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, head_dim, num_qo_heads,
                                            num_kv_heads, rope_base, rotary_dim, is_neox, cos_sin_cache, False)
    return q_rot, k_rot


@_rope.register_fake
def _(q, k, v, positions, slots, k_pool, v_pool, head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim,
      is_neox, cos_sin_cache):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("attnprep::rope_pool_fused_inplace", mutates_args=("q", "k", "k_pool", "v_pool"))
def _rope_inplace(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, slots: Tensor, k_pool: Tensor,
                  v_pool: Tensor, head_dim: int, num_qo_heads: int, num_kv_heads: int, rope_base: float,
                  rotary_dim: int, is_neox: bool, cos_sin_cache: Optional[Tensor]) -> None:
    _C.rope_pool_fused(q, k, v, positions, slots, k_pool, v_pool, head_dim, num_qo_heads, num_kv_heads, rope_base,
                       rotary_dim, is_neox, cos_sin_cache, True)


@_rope_inplace.register_fake
def _(q, k, v, positions, slots, k_pool, v_pool, head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim,
      is_neox, cos_sin_cache):
    return None


def _check_on_host(slots: Tensor, pool_size: int, positions: Tensor, cos_sin_cache: Optional[Tensor]) -> None:
    # One device-to-host copy of the maxima: the documented cost of check_slots.
    if slots.numel() and int(slots.max()) >= pool_size:
        raise ValueError("slots must be < pool_size")
    if cos_sin_cache is not None and positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= cos_sin_cache.shape[0]:
            raise ValueError("positions must be in [0, cos_sin_cache.shape[0])")


def rope_pool_fused(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    slots: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    *,
    head_dim: int,
    num_qo_heads: int,
    num_kv_heads: int,
    rope_base: float,
    rotary_dim: Optional[int] = None,
    is_neox: bool = True,
    cos_sin_cache: Optional[Tensor] = None,
    inplace: bool = False,
    check_slots: Optional[bool] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Rotary embedding on q and k, and the rotated k plus raw v into a flat KV pool.

    q ``[T, num_qo_heads, head_dim]``, k and v ``[T, num_kv_heads, head_dim]``,
    positions and slots ``[T]`` (int32 or int64), pools ``[pool_size,
    num_kv_heads, head_dim]`` (any row stride). Returns ``(q_rot, k_rot,
    k_pool, v_pool)``; the pools are updated in place and returned as the
    same objects. ``slots[t] < 0`` skips the pool write of token t, and a slot
    ``>= pool_size`` is never written; ``check_slots=True`` (or
    ``ATTNPREP_CHECK_SLOTS=1`` in the environment when attnprep is imported) raises ``ValueError("slots must be <
    pool_size")`` instead, at the cost of one host synchronisation.

    NeoX style (rotate halves) by default, GPT-J pairs with ``is_neox=False``;
    ``rotary_dim`` < head_dim rotates the first rotary_dim elements and passes
    the rest through; ``cos_sin_cache`` (``[max_position, rotary_dim]``, cos
    half then sin half, float32 or bfloat16) replaces the table built from
    ``rope_base``; ``inplace=True`` writes q_rot/k_rot into q/k.
    """
    rd = -1 if rotary_dim is None else rotary_dim
    args = (q, k, v, positions, slots, k_pool, v_pool, head_dim, num_qo_heads, num_kv_heads, float(rope_base), rd,
            is_neox, cos_sin_cache)
    if check_slots or (check_slots is None and _CHECK_SLOTS_ENV):
        _C.rope_pool_check(*args)  # the documented checks come first
        _check_on_host(slots, k_pool.shape[0], positions, cos_sin_cache)
    if q.device.type == "mps":
        from . import metal

        return metal.rope_pool_fused(*args, inplace)
    if direct(q, k, v, positions, slots, k_pool, v_pool, cos_sin_cache):
        return _C.rope_pool_fused(*args, inplace)
    if inplace:
        torch.ops.attnprep.rope_pool_fused_inplace(*args)
        return q, k, k_pool, v_pool
    q_rot, k_rot = torch.ops.attnprep.rope_pool_fused(*args)
    return q_rot, k_rot, k_pool, v_pool
