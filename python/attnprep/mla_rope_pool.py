"""mla_rope_pool_fused: multi-head latent attention's RoPE and latent-cache write, in one launch."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _ops
from ._dispatch import bool_arg, direct, float_arg, refuse_grad, tensor_arg

Tensor = torch.Tensor
_OP = "mla_rope_pool_fused"


def mla_rope_pool_fused(
    q: Tensor,
    kv_c: Tensor,
    k_pe: Tensor,
    positions: Tensor,
    slots: Tensor,
    kv_cache: Tensor,
    *,
    rope_base: float = 10000.0,
    is_neox: bool = False,
    cos_sin_cache: Optional[Tensor] = None,
    kv_norm_weight: Optional[Tensor] = None,
    norm_eps: float = 1e-6,
    kpe_cache: Optional[Tensor] = None,
    cache_scale: Optional[Tensor] = None,
    q_scale: Optional[Tensor] = None,
    inplace: bool = False,
    check_slots: Optional[bool] = None,
) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """RoPE on q's rope part and on k_pe, the RMSNorm of kv_c, and the latent-cache write of MLA, one launch.

    DeepSeek-V2/V3/R1 and Kimi K2 attention between the projections and attention: each head of q is ``[nope |
    rope]`` and only its last ``R = k_pe.shape[1]`` elements rotate; ``[kv_c normalized | k_pe rotated]`` is written
    at ``slots[t]`` of the latent cache. Enqueued on the current CUDA stream; safe in CUDA graphs and under
    ``torch.compile``.

    Parameters
    ----------
    q : torch.Tensor
        ``[T, heads, nope + R]``, float16, bfloat16 or float32, any row and head strides, a unit last stride.
    kv_c : torch.Tensor
        ``[T, L]`` (``L = kv_lora_rank``), q's dtype: the compressed kv, a slice of the projection output is fine.
    k_pe : torch.Tensor
        ``[T, R]``, q's dtype: the key's shared rope part.
    positions, slots : torch.Tensor
        ``[T]``, int32 or int64. A negative slot skips the token's cache write; a slot past the cache is never
        written.
    kv_cache : torch.Tensor
        ``[slots, L + R]`` or paged ``[pages, page_size, L + R]`` (``[..., L]`` with ``kpe_cache``), q's dtype or
        float8_e4m3fn / float8_e5m2 with ``cache_scale``; any strides but the last.
    rope_base : float
        The base of the table built on the fly (unused with ``cos_sin_cache``).
    is_neox : bool
        GPT-J pairs (``False``, DeepSeek's layout) or NeoX halves.
    cos_sin_cache : torch.Tensor, optional
        ``[max_position, R]``, cos half then sin half, float32 or bfloat16 (``rope_cos_sin_cache`` with the
        model's ``rope_scaling``, YaRN's mscale included).
    kv_norm_weight : torch.Tensor, optional
        ``[L]``, float32 or q's dtype: RMS-normalize kv_c (the model's ``kv_a_layernorm``) before the write.
    norm_eps : float
        Inside the square root of the norm.
    kpe_cache : torch.Tensor, optional
        ``[slots, R]`` or ``[pages, page_size, R]``: the rotated k_pe goes here, kv_cache holds kv_c alone.
    cache_scale : torch.Tensor, optional
        float32 on the device, one value, for fp8 caches: the cache stores ``x / scale``.
    q_scale : torch.Tensor, optional
        float32 on the device, one value: q_rot is float8_e4m3fn holding ``q_rot / q_scale`` (not in place).
    inplace : bool
        Rotate q's rope part and k_pe in place and return them.
    check_slots : bool, optional
        As :func:`rope_pool_fused`'s: slots and positions checked on the host, at the cost of a synchronisation.

    Returns
    -------
    tuple
        ``(q_rot, k_pe_rot, kv_cache, kpe_cache)``: q and k_pe rotated (themselves with ``inplace``), and the caches
        updated in place (``kpe_cache`` None when not given).

    Raises
    ------
    TypeError
        An argument of the wrong type.
    ValueError
        The messages of the contract (``contract.md`` in the package), in their order; nothing is written.

    Examples
    --------
    >>> T, H, L, R = 5, 16, 512, 64
    >>> q = torch.randn(T, H, 128 + R, device="cuda", dtype=torch.bfloat16)
    >>> kv = torch.randn(T, L + R, device="cuda", dtype=torch.bfloat16)  # the projection's [kv_c | k_pe]
    >>> cache = torch.zeros(8, 64, L + R, device="cuda", dtype=torch.bfloat16)  # 8 pages of 64 slots
    >>> positions, slots = torch.arange(T, device="cuda"), torch.arange(70, 70 + T, device="cuda")
    >>> q_rot, k_pe_rot, _, _ = mla_rope_pool_fused(q, kv[:, :L], kv[:, L:], positions, slots, cache)
    >>> torch.equal(cache[1, 6, L:], k_pe_rot[0]) and torch.equal(cache[1, 6, :L], kv[0, :L])
    True
    """
    args = (q, kv_c, k_pe, positions, slots, kv_cache, rope_base, is_neox, cos_sin_cache, kv_norm_weight, norm_eps)
    args += (kpe_cache, cache_scale, q_scale)
    if check_slots is not None and not isinstance(check_slots, bool):
        _read_args(args, inplace)
        bool_arg(check_slots, _OP, "check_slots")
    check = _ops.CHECK_SLOTS_ENV if check_slots is None else check_slots
    tensors = (q, kv_c, k_pe, positions, slots, kv_cache, cos_sin_cache, kv_norm_weight, kpe_cache)
    on_mps = isinstance(q, Tensor) and q.device.type == "mps"  # (MPS: its registered Metal kernel)
    if direct(*tensors, cache_scale, q_scale) and not on_mps:
        return _ops.mla_run(inplace, *args, check)
    args, inplace = _read_args(args, inplace)
    refuse_grad(_OP, *(x for x in args if isinstance(x, Tensor)))
    if inplace:
        torch.ops.attnprep.mla_rope_pool_fused_inplace(*args, check)
        return q, k_pe, kv_cache, kpe_cache
    q_rot, k_pe_rot = torch.ops.attnprep.mla_rope_pool_fused(*args, check)
    return q_rot, k_pe_rot, kv_cache, kpe_cache


def _read_args(args: tuple, inplace) -> Tuple[tuple, bool]:
    """The arguments as the extension reads them, in its turn, for the calls through torch's dispatcher (whose schema
    would see the raw values first)."""
    names = ("q", "kv_c", "k_pe", "positions", "slots", "kv_cache")
    tensors = tuple(tensor_arg(x, n) for x, n in zip(args, names))
    rope_base = float_arg(args[6], _OP, "rope_base")
    is_neox = bool_arg(args[7], _OP, "is_neox")
    cos_sin_cache = tensor_arg(args[8], "cos_sin_cache", optional=True)
    kv_norm_weight = tensor_arg(args[9], "kv_norm_weight", optional=True)
    norm_eps = float_arg(args[10], _OP, "norm_eps")
    rest = tuple(tensor_arg(x, n, optional=True) for x, n in zip(args[11:], ("kpe_cache", "cache_scale", "q_scale")))
    inplace = bool_arg(inplace, _OP, "inplace")
    return (*tensors, rope_base, is_neox, cos_sin_cache, kv_norm_weight, norm_eps, *rest), inplace
