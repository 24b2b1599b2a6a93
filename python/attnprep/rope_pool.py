"""rope_pool_fused: RoPE on q and k plus the KV-pool write, in one launch."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _C, _ops
from ._dispatch import bool_arg, direct, float_arg, int_arg, tensor_arg

Tensor = torch.Tensor
_OP = "rope_pool_fused"


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
    k_scale: Optional[Tensor] = None,
    v_scale: Optional[Tensor] = None,
    kv_layout: str = "NHD",
    q_norm_weight: Optional[Tensor] = None,
    k_norm_weight: Optional[Tensor] = None,
    norm_eps: float = 1e-6,
    norm_weight_offset: float = 0.0,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Rotary embedding on q and k, and the rotated k plus raw v into a KV cache.

    q ``[T, num_qo_heads, head_dim]``, k and v ``[T, num_kv_heads, head_dim]``,
    positions and slots ``[T]`` (int32 or int64). Pools: ``[slots,
    num_kv_heads, head_dim]``, or paged ``[pages, page_size, num_kv_heads,
    head_dim]`` (``kv_layout="NHD"``) / ``[pages, num_kv_heads, page_size,
    head_dim]`` (``"HND"``), where slot s is page s // page_size, offset s %
    page_size; any strides but the last (one layer of a larger buffer, the k
    and v halves of one combined cache). Pools of q's dtype, or
    float8_e4m3fn / float8_e5m2 with ``k_scale`` and ``v_scale`` (float32 on
    the device, one value or one per kv head): the pool stores ``x / scale``
    rounded to nearest even and saturated; q_rot and k_rot stay unquantized.
    Returns ``(q_rot, k_rot, k_pool, v_pool)``; the pools are updated in
    place and returned as the same objects. ``slots[t] < 0`` skips the pool write of token t, and a slot
    ``>= pool_size`` is never written; ``check_slots=True`` (or
    ``ATTNPREP_CHECK_SLOTS=1`` in the environment when attnprep is imported)
    raises ``ValueError("slots must be < pool_size")`` instead, at the cost of
    one host synchronisation (so not inside CUDA-graph capture).

    NeoX style (rotate halves) by default, GPT-J pairs with ``is_neox=False``;
    ``rotary_dim`` < head_dim rotates the first rotary_dim elements and passes
    the rest through; ``cos_sin_cache`` (``[max_position, rotary_dim]``, cos
    half then sin half, float32 or bfloat16) replaces the table built from
    ``rope_base``; ``inplace=True`` writes q_rot/k_rot into q/k.

    ``q_norm_weight`` / ``k_norm_weight`` (``[head_dim]``, float32 or q's
    dtype) RMS-normalize each q / k head over head_dim before the rotation, as
    Qwen3 (``norm_weight_offset=0``: ``weight * normalized.to(dtype)``) and
    Gemma 3 (``norm_weight_offset=1``: ``(1 + weight) * normalized`` in
    float32) do, with ``norm_eps`` inside the square root; v is untouched.

    Raises ValueError with the messages of docs/contract.md, in their order.
    """
    if check_slots is not None and not isinstance(check_slots, bool):
        # in its turn: an earlier argument of the wrong type names itself first
        _read_args(q, k, v, positions, slots, k_pool, v_pool, head_dim, num_qo_heads, num_kv_heads, rope_base,
                   rotary_dim, is_neox, cos_sin_cache, k_scale, v_scale, kv_layout, q_norm_weight, k_norm_weight,
                   norm_eps, norm_weight_offset, inplace=inplace, check_slots=check_slots)
    check = _ops.CHECK_SLOTS_ENV if check_slots is None else check_slots
    args = (q, k, v, positions, slots, k_pool, v_pool, head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim,
            is_neox, cos_sin_cache, k_scale, v_scale, kv_layout, q_norm_weight, k_norm_weight, norm_eps,
            norm_weight_offset, check)
    if direct(q, k, v, positions, slots, k_pool, v_pool, cos_sin_cache, k_scale, v_scale, q_norm_weight,
              k_norm_weight):
        if not check:
            out = _C.rope_pool_fused(*args[:14], inplace, *args[14:-1])
        else:
            out = _ops.rope_run(_C.rope_pool_fused, inplace, *args)
        if out is not None:
            return out
        # MPS tensors: on to their registered kernel, which validates; the
        # extension has read the arguments and, when asked for, run the host check
        args = args[:-1] + (False,)
    else:
        args, inplace = _read_args(*args[:-1], inplace=inplace)
        args += (check,)
    if inplace:
        torch.ops.attnprep.rope_pool_fused_inplace(*args)
        return q, k, k_pool, v_pool
    q_rot, k_rot = torch.ops.attnprep.rope_pool_fused(*args)
    return q_rot, k_rot, k_pool, v_pool


def _read_args(q, k, v, positions, slots, k_pool, v_pool, head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim,
               is_neox, cos_sin_cache, k_scale, v_scale, kv_layout, q_norm_weight, k_norm_weight, norm_eps,
               norm_weight_offset, *, inplace, check_slots=None):
    """The arguments (and ``inplace``) as the extension reads them, in its
    order, for the calls that go through torch's dispatcher (``_dispatch``:
    its schema would see the raw values first). ``check_slots`` (None or a
    bool, read here in its turn; the caller resolves None) is not returned."""
    q, k, v = tensor_arg(q, "q"), tensor_arg(k, "k"), tensor_arg(v, "v")
    positions, slots = tensor_arg(positions, "positions"), tensor_arg(slots, "slots")
    k_pool, v_pool = tensor_arg(k_pool, "k_pool"), tensor_arg(v_pool, "v_pool")
    head_dim = int_arg(head_dim, _OP, "head_dim")
    num_qo_heads = int_arg(num_qo_heads, _OP, "num_qo_heads")
    num_kv_heads = int_arg(num_kv_heads, _OP, "num_kv_heads")
    rope_base = float_arg(rope_base, _OP, "rope_base")
    rotary_dim = None if rotary_dim is None else int_arg(rotary_dim, _OP, "rotary_dim")
    is_neox = bool_arg(is_neox, _OP, "is_neox")
    cos_sin_cache = tensor_arg(cos_sin_cache, "cos_sin_cache", optional=True)
    inplace = bool_arg(inplace, _OP, "inplace")
    if check_slots is not None:
        bool_arg(check_slots, _OP, "check_slots")
    k_scale = tensor_arg(k_scale, "k_scale", optional=True)
    v_scale = tensor_arg(v_scale, "v_scale", optional=True)
    if not isinstance(kv_layout, str):
        raise TypeError(f"{_OP}: kv_layout must be a str, got {type(kv_layout).__name__}")
    q_norm_weight = tensor_arg(q_norm_weight, "q_norm_weight", optional=True)
    k_norm_weight = tensor_arg(k_norm_weight, "k_norm_weight", optional=True)
    norm_eps = float_arg(norm_eps, _OP, "norm_eps")
    norm_weight_offset = float_arg(norm_weight_offset, _OP, "norm_weight_offset")
    return (q, k, v, positions, slots, k_pool, v_pool, head_dim, num_qo_heads, num_kv_heads, rope_base, rotary_dim,
            is_neox, cos_sin_cache, k_scale, v_scale, kv_layout, q_norm_weight, k_norm_weight, norm_eps,
            norm_weight_offset), inplace
