"""The ops as torch's dispatcher knows them: ``torch.ops.attnprep.*``.

The public functions call the extension directly for plain eager tensors
(``_dispatch.direct``) and go through these registrations otherwise: under
torch.compile and FakeTensor tracing, for tensor subclasses, and on Apple GPUs
(the Metal kernel is the op's kernel for the MPS device).

Registered with ``torch.library.Library`` (``define`` + ``impl`` per dispatch
key) rather than ``torch.library.custom_op``: the dispatcher then reaches the
kernel in a few microseconds, where custom_op's Python layers cost 20-30 per
call. The fake kernels run the same C++ checks as the real ones, on metadata
alone, so a traced call fails with the documented message (inside dynamo's
error, as the ValueError that caused it) and never with a shape error.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional, Sequence

import torch

from . import _C

Tensor = torch.Tensor

# Read once, at import: a per-call environment lookup would cost more than
# the launch of a small call.
CHECK_SLOTS_ENV = os.environ.get("ATTNPREP_CHECK_SLOTS", "0") not in ("", "0")

_lib = torch.library.Library("attnprep", "DEF")

_ROPE_ARGS = (
    "Tensor? v, Tensor? positions, Tensor? slots, Tensor(c!)? k_pool, Tensor(d!)? v_pool, int head_dim, "
    "int num_qo_heads, int num_kv_heads, float rope_base, int? rotary_dim, bool is_neox, "
    "Tensor? cos_sin_cache, Tensor? k_scale, Tensor? v_scale, str kv_layout, Tensor? q_norm_weight, "
    "Tensor? k_norm_weight, float norm_eps, float norm_weight_offset, int[]? mrope_section, "
    "bool mrope_interleaved, Tensor? q_scale, bool check_slots"
)
_lib.define("pack_qkv_destination_major(Tensor q, Tensor k, Tensor v, int world_size) -> Tensor")
_lib.define("pack_qkv_destination_major_out(Tensor q, Tensor k, Tensor v, int world_size, Tensor(a!) out) -> ()")
_lib.define("usp_merge_heads(Tensor x) -> Tensor")
_lib.define(f"rope_pool_fused(Tensor q, Tensor k, {_ROPE_ARGS}) -> (Tensor, Tensor)")
_lib.define(f"rope_pool_fused_inplace(Tensor(a!) q, Tensor(b!) k, {_ROPE_ARGS}) -> ()")
_lib.define("_qk_token_rms_norm(Tensor x, Tensor weight, float eps, float offset, Tensor(a!) out) -> ()")
_MLA_ARGS = (
    "Tensor positions, Tensor slots, Tensor(c!) kv_cache, float rope_base, bool is_neox, Tensor? cos_sin_cache, "
    "Tensor? kv_norm_weight, float norm_eps, Tensor(d!)? kpe_cache, Tensor? cache_scale, Tensor? q_scale, "
    "bool check_slots"
)
_lib.define(f"mla_rope_pool_fused(Tensor q, Tensor kv_c, Tensor k_pe, {_MLA_ARGS}) -> (Tensor, Tensor)")
_lib.define(f"mla_rope_pool_fused_inplace(Tensor(a!) q, Tensor kv_c, Tensor(b!) k_pe, {_MLA_ARGS}) -> ()")

# One kernel for every device: the extension validates (a CPU tensor gets the
# documented device message) and launches. MPS gets the Metal kernel below.
_ANY = "CompositeExplicitAutograd"


def pool_slots(k_pool: Optional[Tensor], kv_layout: str) -> int:
    """Slots of a checked pool: [slots, H, D], or pages x page_size of a paged one (none without a pool)."""
    if k_pool is None:
        return 0
    if k_pool.dim() == 3:
        return k_pool.shape[0]
    return k_pool.shape[0] * (k_pool.shape[1] if kv_layout == "NHD" else k_pool.shape[2])


def check_slots_on_host(
    slots: Optional[Tensor], pool_size: int, positions: Optional[Tensor], cos_sin_cache: Optional[Tensor]
) -> None:
    """``check_slots``: one device-to-host copy of the extremes (its documented cost)."""
    if slots is not None and slots.numel() and int(slots.max()) >= pool_size:
        raise ValueError("slots must be < pool_size")
    if cos_sin_cache is not None and positions is not None and positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= cos_sin_cache.shape[0]:
            raise ValueError("positions must be in [0, cos_sin_cache.shape[0])")


def _pack(q, k, v, world_size):
    return _C.pack_qkv_destination_major(q, k, v, world_size, None)


def _pack_out(q, k, v, world_size, out):
    _C.pack_qkv_destination_major(q, k, v, world_size, out)


def _pack_fake(q, k, v, world_size):
    return q.new_empty(_C._pack_qkv_meta(q, k, v, world_size, None))


def _pack_out_fake(q, k, v, world_size, out):
    _C._pack_qkv_meta(q, k, v, world_size, out)


def _merge(x):
    return _C.usp_merge_heads(x)


def _merge_fake(x):
    return x.new_empty(_C._usp_merge_heads_meta(x))


class RopeArgs(NamedTuple):
    """rope_pool_fused's arguments in the dispatcher schema's order (_ROPE_ARGS)."""

    q: Tensor
    k: Tensor
    v: Optional[Tensor]
    positions: Optional[Tensor]
    slots: Optional[Tensor]
    k_pool: Optional[Tensor]
    v_pool: Optional[Tensor]
    head_dim: int
    num_qo_heads: int
    num_kv_heads: int
    rope_base: float
    rotary_dim: Optional[int]
    is_neox: bool
    cos_sin_cache: Optional[Tensor]
    k_scale: Optional[Tensor]
    v_scale: Optional[Tensor]
    kv_layout: str
    q_norm_weight: Optional[Tensor]
    k_norm_weight: Optional[Tensor]
    norm_eps: float
    norm_weight_offset: float
    mrope_section: Optional[Sequence[int]]
    mrope_interleaved: bool
    q_scale: Optional[Tensor] = None

    def for_extension(self, inplace) -> tuple:
        """The extension's positional order: ``inplace`` follows cos_sin_cache."""
        return (*self[:_INPLACE_AT], inplace, *self[_INPLACE_AT:])

    @classmethod
    def from_extension(cls, args) -> tuple:
        """The inverse of for_extension: ``(RopeArgs, inplace)``."""
        return cls(*args[:_INPLACE_AT], *args[_INPLACE_AT + 1 :]), args[_INPLACE_AT]


_INPLACE_AT = RopeArgs._fields.index("cos_sin_cache") + 1  # where the extension takes ``inplace``


def rope_run(kernel, inplace, *schema_args):
    """``kernel`` (the extension's or the Metal one) after the host check of
    ``check_slots``, the schema's last argument; the one place that check
    runs, for both call paths."""
    a, check_slots = RopeArgs(*schema_args[:-1]), schema_args[-1]
    args = a.for_extension(inplace)
    if check_slots:
        _C.rope_pool_check(*args)  # the documented checks come first
        check_slots_on_host(a.slots, pool_slots(a.k_pool, a.kv_layout), a.positions, a.cos_sin_cache)
    return kernel(*args)


def _metal_module():
    from . import metal

    return metal


def _metal(*args):
    return _metal_module().rope_pool_fused(*args)


def _rope(*args):
    return rope_run(_C.rope_pool_fused, False, *args)[:2]


def _rope_inplace(*args):
    rope_run(_C.rope_pool_fused, True, *args)


def _rope_mps(*args):
    return rope_run(_metal, False, *args)[:2]


def _rope_inplace_mps(*args):
    rope_run(_metal, True, *args)


def _rope_check_fake(inplace, *schema_args):
    """The extension's checks on metadata alone (``check_slots``, the last
    argument, runs when the compiled graph calls the op)."""
    _C.rope_pool_check(*RopeArgs(*schema_args[:-1]).for_extension(inplace), metadata_only=True)


def _rope_fake(q, k, *rest):
    _rope_check_fake(False, q, k, *rest)
    fp8_q = RopeArgs(q, k, *rest[:-1]).q_scale is not None
    return q.new_empty(q.shape, dtype=torch.float8_e4m3fn if fp8_q else q.dtype), k.new_empty(k.shape)


def _rope_inplace_fake(*args):
    _rope_check_fake(True, *args)


def _token_norm(x, weight, eps, offset, out):
    _C._qk_token_rms_norm(x, weight, eps, offset, out)


def _token_norm_fake(x, weight, eps, offset, out):
    _C._qk_token_rms_norm(x, weight, eps, offset, out, metadata_only=True)


def mla_check_slots(args, inplace) -> None:
    """mla_rope_pool_fused's ``check_slots``: the documented checks first, then the host check (``args`` in the
    extension's order without ``inplace``)."""
    _C.mla_rope_pool_check(*args, inplace)
    kv_cache = args[5]
    slots = kv_cache.shape[0] * (kv_cache.shape[1] if kv_cache.dim() == 3 else 1)
    check_slots_on_host(args[4], slots, args[3], args[8])


def mla_run(inplace, *schema_args):
    """mla_rope_pool_fused's extension call after the host check of ``check_slots`` (the schema's last argument);
    the extension takes ``inplace`` last instead."""
    *args, check_slots = schema_args
    if check_slots:
        mla_check_slots(args, inplace)
    return _C.mla_rope_pool_fused(*args, inplace)


def _mla(*args):
    return mla_run(False, *args)[:2]


def _mla_inplace(*args):
    mla_run(True, *args)


def _mla_mps(*args):
    return _metal_module().mla_rope_pool_fused(False, *args)[:2]


def _mla_inplace_mps(*args):
    _metal_module().mla_rope_pool_fused(True, *args)


def _mla_fake(q, kv_c, k_pe, *rest):
    _C.mla_rope_pool_check(q, kv_c, k_pe, *rest[:-1], False, metadata_only=True)
    fp8_q = rest[10] is not None  # q_scale
    return q.new_empty(q.shape, dtype=torch.float8_e4m3fn if fp8_q else q.dtype), k_pe.new_empty(k_pe.shape)


def _mla_inplace_fake(*args):
    _C.mla_rope_pool_check(*args[:-1], True, metadata_only=True)


for _name, _kernel, _fake in [
    ("pack_qkv_destination_major", _pack, _pack_fake),
    ("pack_qkv_destination_major_out", _pack_out, _pack_out_fake),
    ("usp_merge_heads", _merge, _merge_fake),
    ("rope_pool_fused", _rope, _rope_fake),
    ("rope_pool_fused_inplace", _rope_inplace, _rope_inplace_fake),
    ("_qk_token_rms_norm", _token_norm, _token_norm_fake),
    ("mla_rope_pool_fused", _mla, _mla_fake),
    ("mla_rope_pool_fused_inplace", _mla_inplace, _mla_inplace_fake),
]:
    _lib.impl(_name, _kernel, _ANY)
    torch.library.register_fake(f"attnprep::{_name}", _fake, lib=_lib)
_lib.impl("rope_pool_fused", _rope_mps, "MPS")
_lib.impl("_qk_token_rms_norm", lambda *args: _metal_module().token_rms_norm(*args), "MPS")
_lib.impl("rope_pool_fused_inplace", _rope_inplace_mps, "MPS")
_lib.impl("mla_rope_pool_fused", _mla_mps, "MPS")
_lib.impl("mla_rope_pool_fused_inplace", _mla_inplace_mps, "MPS")
