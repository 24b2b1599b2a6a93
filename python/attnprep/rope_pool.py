"""rope_pool_fused: RoPE on q and k plus the KV-pool write, in one launch."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from . import _C, _ops
from ._dispatch import bool_arg, direct, float_arg, int_arg, refuse_grad, tensor_arg

Tensor = torch.Tensor
_OP = "rope_pool_fused"


def rope_pool_fused(
    q: Tensor,
    k: Tensor,
    v: Optional[Tensor],
    positions: Optional[Tensor],
    slots: Optional[Tensor],
    k_pool: Optional[Tensor],
    v_pool: Optional[Tensor],
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
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
    q_scale: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """RoPE on q and k (after an optional per-head RMSNorm) and the KV-cache write, one launch.

    Every token's q and k heads are rotated by its position; the rotated k and
    the raw v are written to the cache slot ``slots[t]``. Enqueued on the
    current CUDA stream (or the MPS stream); safe in CUDA graphs and under
    ``torch.compile``.

    Parameters
    ----------
    q : torch.Tensor
        ``[T, num_qo_heads, head_dim]``, float16, bfloat16 or float32; any
        row and head strides, a unit-stride last dimension.
    k, v : torch.Tensor
        ``[T, num_kv_heads, head_dim]``, q's dtype and device. ``v``,
        ``slots`` and the pools may all be None: RoPE (and the QK norm) of
        q and k alone, no cache write (what :func:`qk_norm_rope` does).
    positions : torch.Tensor or None
        ``[T]``, int32 or int64, any stride: each token's position (its row
        of ``cos_sin_cache``). ``[3, T]`` with ``mrope_section``: M-RoPE's
        time, height and width positions. None: per-token cos/sin, token t
        reads row t of ``cos_sin_cache``, which then has ``T`` rows (a
        model's precomputed cos/sin, e.g. from :func:`rope_cos_sin_rows`).
    slots : torch.Tensor
        ``[T]``, int32 or int64. ``slots[t] < 0`` skips token t's cache
        write; a slot ``>= pool_size`` is never written.
    k_pool, v_pool : torch.Tensor
        The cache: ``[slots, num_kv_heads, head_dim]``, or paged
        ``[pages, page_size, num_kv_heads, head_dim]`` (``kv_layout="NHD"``)
        or ``[pages, num_kv_heads, page_size, head_dim]`` (``"HND"``), where
        slot s is page ``s // page_size``, offset ``s % page_size``; any
        strides but the last. q's dtype, or float8_e4m3fn / float8_e5m2 with
        ``k_scale`` and ``v_scale``.
    head_dim, num_qo_heads, num_kv_heads : int
        The geometry, checked against the tensors.
    rope_base : float
        The base of the table built on the fly (unused with ``cos_sin_cache``).
    rotary_dim : int, optional
        Rotate the first ``rotary_dim`` elements of each head, pass the rest
        through (default: ``head_dim``).
    is_neox : bool
        NeoX style (rotate halves, default) or GPT-J pairs (``False``).
    cos_sin_cache : torch.Tensor, optional
        ``[max_position, rotary_dim]``, cos half then sin half, float32 or
        bfloat16 (:func:`rope_cos_sin_cache` builds it for every scaling
        scheme); replaces the table built from ``rope_base``.
    inplace : bool
        Write the rotated q and k into ``q`` and ``k``.
    check_slots : bool, optional
        Raise ``ValueError("slots must be < pool_size")`` for a slot past the
        pool, at the cost of one host synchronisation (not inside CUDA-graph
        capture). Default: ``ATTNPREP_CHECK_SLOTS=1`` in the environment at
        import.
    k_scale, v_scale : torch.Tensor, optional
        float32 on the device, one value or one per kv head, for fp8 pools:
        the pool stores ``x / scale`` rounded to nearest even and saturated.
    kv_layout : str
        ``"NHD"`` (default) or ``"HND"``, for paged pools.
    q_norm_weight, k_norm_weight : torch.Tensor, optional
        ``[head_dim]``, float32 or q's dtype: RMS-normalize each q / k head
        over head_dim before the rotation, as Qwen3 and Gemma 3 do.
    norm_eps : float
        Inside the square root of the norm.
    norm_weight_offset : float
        0: ``weight * normalized.to(dtype)`` (Qwen3); 1: ``(1 + weight) *
        normalized`` in float32 (Gemma 3).
    mrope_section : sequence of int, optional
        M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the frequencies rotated by
        the time, height and width positions, summing to ``rotary_dim // 2``
        (the config's ``rope_scaling["mrope_section"]``); positions are then
        ``[3, T]``.
    mrope_interleaved : bool
        The sections' frequencies interleaved (Qwen3-VL) instead of
        consecutive (Qwen2-VL, Qwen2.5-VL).
    q_scale : torch.Tensor, optional
        float32 on the device, one value (``[]`` or ``[1]``): q_rot is
        float8_e4m3fn holding ``q_rot / q_scale`` rounded to nearest even and
        saturated (fp8 attention kernels; CUDA, not in place).

    Returns
    -------
    tuple of torch.Tensor
        ``(q_rot, k_rot, k_pool, v_pool)``: the rotated q and k (``q`` and
        ``k`` themselves with ``inplace``), and the pools, updated in place.

    Raises
    ------
    TypeError
        An argument of the wrong type (``"rope_pool_fused: head_dim must be
        an int, got str"``).
    ValueError
        The messages of the contract (``contract.md`` in the package), in
        their order, with the offending values as a note; nothing is written.

    Examples
    --------
    >>> T, D = 17, 128
    >>> q = torch.randn(T, 32, D, device="cuda", dtype=torch.bfloat16)
    >>> k, v = (torch.randn(T, 8, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    >>> k_pool, v_pool = (torch.zeros(64, 16, 8, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    >>> positions = torch.arange(T, device="cuda")
    >>> slots = torch.arange(100, 100 + T, device="cuda")
    >>> q_rot, k_rot, _, _ = rope_pool_fused(
    ...     q, k, v, positions, slots, k_pool, v_pool, head_dim=D, num_qo_heads=32, num_kv_heads=8, rope_base=1e4
    ... )
    >>> torch.equal(k_pool[100 // 16, 100 % 16], k_rot[0])
    True
    >>> torch.equal(v_pool[116 // 16, 116 % 16], v[16])
    True
    """
    a = _ops.RopeArgs(
        q,
        k,
        v,
        positions,
        slots,
        k_pool,
        v_pool,
        head_dim,
        num_qo_heads,
        num_kv_heads,
        rope_base,
        rotary_dim,
        is_neox,
        cos_sin_cache,
        k_scale,
        v_scale,
        kv_layout,
        q_norm_weight,
        k_norm_weight,
        norm_eps,
        norm_weight_offset,
        mrope_section,
        mrope_interleaved,
        q_scale,
    )
    if check_slots is not None and not isinstance(check_slots, bool):
        # raises in its turn: an earlier argument of the wrong type names itself first
        _read_args(a, inplace, check_slots)
    check = _ops.CHECK_SLOTS_ENV if check_slots is None else check_slots
    if direct(
        q,
        k,
        v,
        positions,
        slots,
        k_pool,
        v_pool,
        cos_sin_cache,
        k_scale,
        v_scale,
        q_norm_weight,
        k_norm_weight,
        q_scale,
    ):
        if check:
            out = _ops.rope_run(_C.rope_pool_fused, inplace, *a, check)
        else:
            out = _C.rope_pool_fused(*a.for_extension(inplace))
        if out is not None:
            return out
        # MPS tensors: on to their registered kernel, which validates; the
        # extension has read the arguments and, when asked for, run the host check
        check = False
    else:
        a, inplace = _read_args(a, inplace)
        refuse_grad(_OP, *(x for x in a if isinstance(x, torch.Tensor)))
    if inplace:
        torch.ops.attnprep.rope_pool_fused_inplace(*a, check)
        return q, k, k_pool, v_pool
    q_rot, k_rot = torch.ops.attnprep.rope_pool_fused(*a, check)
    return q_rot, k_rot, k_pool, v_pool


def _read_args(a: _ops.RopeArgs, inplace, check_slots=None) -> Tuple[_ops.RopeArgs, bool]:
    """The arguments (and ``inplace``) as the extension reads them, in its
    turn, for the calls that go through torch's dispatcher (``_dispatch``:
    its schema would see the raw values first). ``check_slots`` (None or a
    bool, read here in its turn; the caller resolves None) is not returned."""
    optional = ("v", "positions", "slots", "k_pool", "v_pool")
    names = ("q", "k", "v", "positions", "slots", "k_pool", "v_pool")
    tensors = {n: tensor_arg(getattr(a, n), n, optional=n in optional) for n in names}
    ints = {n: int_arg(getattr(a, n), _OP, n) for n in ("head_dim", "num_qo_heads", "num_kv_heads")}
    rope_base = float_arg(a.rope_base, _OP, "rope_base")
    rotary_dim = None if a.rotary_dim is None else int_arg(a.rotary_dim, _OP, "rotary_dim")
    is_neox = bool_arg(a.is_neox, _OP, "is_neox")
    cos_sin_cache = tensor_arg(a.cos_sin_cache, "cos_sin_cache", optional=True)
    inplace = bool_arg(inplace, _OP, "inplace")
    if check_slots is not None:
        bool_arg(check_slots, _OP, "check_slots")
    k_scale = tensor_arg(a.k_scale, "k_scale", optional=True)
    v_scale = tensor_arg(a.v_scale, "v_scale", optional=True)
    if not isinstance(a.kv_layout, str):
        raise TypeError(f"{_OP}: kv_layout must be a str, got {type(a.kv_layout).__name__}")
    q_norm_weight = tensor_arg(a.q_norm_weight, "q_norm_weight", optional=True)
    k_norm_weight = tensor_arg(a.k_norm_weight, "k_norm_weight", optional=True)
    norm_eps = float_arg(a.norm_eps, _OP, "norm_eps")
    norm_weight_offset = float_arg(a.norm_weight_offset, _OP, "norm_weight_offset")
    mrope_section = a.mrope_section
    if mrope_section is not None:
        if not isinstance(mrope_section, (list, tuple)):
            raise TypeError(f"{_OP}: mrope_section must be a list or tuple of ints, got {type(mrope_section).__name__}")
        mrope_section = [int_arg(n, _OP, "mrope_section") for n in mrope_section]
    mrope_interleaved = bool_arg(a.mrope_interleaved, _OP, "mrope_interleaved")
    q_scale = tensor_arg(a.q_scale, "q_scale", optional=True)
    read = a._replace(
        **tensors,
        **ints,
        rope_base=rope_base,
        rotary_dim=rotary_dim,
        is_neox=is_neox,
        cos_sin_cache=cos_sin_cache,
        k_scale=k_scale,
        v_scale=v_scale,
        q_norm_weight=q_norm_weight,
        k_norm_weight=k_norm_weight,
        norm_eps=norm_eps,
        norm_weight_offset=norm_weight_offset,
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
        q_scale=q_scale,
    )
    return read, inplace
