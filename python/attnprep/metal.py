"""rope_pool_fused and mla_rope_pool_fused on Apple GPUs: their kernels for the MPS device (and qk_norm_rope's
per-token norm).

The kernels are src/metal/rope_pool.metal and token_rms_norm.metal (shipped
in the package as attnprep/metal/). It runs through torch's shader-library API
(``torch.mps.compile_shader``, which takes source), so it is ordered with
torch's other MPS work on torch's MPS stream and needs no synchronisation.
The source is compiled once per process and cached. The macOS CI job also
compiles it with Apple's compiler, warnings as errors.

Validation, the parameter block and the grid come from C++
(``_C.rope_pool_metal_plan``: the same checks and messages as CUDA).
"""

from __future__ import annotations

import functools
from importlib import resources

import torch

from . import _C
from ._ops import RopeArgs, mla_check_slots

_KERNELS = {torch.float16: "rope_pool_half", torch.bfloat16: "rope_pool_bfloat", torch.float32: "rope_pool_float"}


def source(name: str = "rope_pool") -> str:
    """A kernel's source (``rope_pool`` or ``token_rms_norm``) with its parameter header inlined (one compile unit)."""
    here = resources.files("attnprep") / "metal"
    header = "rope_pool_params.h" if name == "rope_pool" else f"{name}_params.h"
    text = (here / f"{name}.metal").read_text()
    return text.replace(f'#include "{header}"', (here / header).read_text())


@functools.lru_cache(maxsize=None)
def _library(name: str = "rope_pool"):
    return torch.mps.compile_shader(source(name))


def rope_pool_fused(*args):
    """The op's Metal kernel; ``args`` in the extension's order (``RopeArgs.for_extension``)."""
    a, inplace = RopeArgs.from_extension(args)
    q, k = a.q, a.k
    q_rot = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_rot = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    params, groups, threads = _C.rope_pool_metal_plan(*args, q_rot, k_rot)
    # an absent tensor is never read (positions_kind 2; no pool: pool_size 0, no v items): any buffer fills its slot
    positions = a.positions if a.positions is not None else q
    slots, v, k_pool, v_pool = (q, q, q_rot, q_rot) if a.slots is None else (a.slots, a.v, a.k_pool, a.v_pool)
    if groups:
        block = torch.frombuffer(bytearray(params), dtype=torch.uint8).to(q.device)
        # without a table the kernel never reads it; any buffer fills the slot
        # (likewise the norm weights; each is passed twice, as float32 and as q's dtype)
        cache = a.cos_sin_cache if a.cos_sin_cache is not None else positions
        qw = a.q_norm_weight if a.q_norm_weight is not None else positions
        kw = a.k_norm_weight if a.k_norm_weight is not None else positions
        kernel = getattr(_library(), _KERNELS[q.dtype])
        kernel(
            q,
            k,
            v,
            q_rot,
            k_rot,
            k_pool,
            v_pool,
            positions,
            slots,
            cache,
            cache,
            block,
            qw,
            qw,
            kw,
            kw,
            threads=groups * threads,
            group_size=threads,
        )
    return q_rot, k_rot, a.k_pool, a.v_pool


def mla_rope_pool_fused(inplace, *schema_args):
    """mla_rope_pool_fused's Metal kernel (``mla_rope_pool`` in rope_pool.metal); ``schema_args`` as the registered
    op takes them (``check_slots`` last)."""
    *args, check_slots = schema_args
    if check_slots:
        mla_check_slots(args, inplace)
    q, kv_c, k_pe, positions, slots, kv_cache = args[:6]
    cos_sin_cache, weight, kpe_cache = args[8], args[9], args[11]
    q_rot = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_pe_rot = k_pe if inplace else torch.empty(k_pe.shape, dtype=k_pe.dtype, device=k_pe.device)
    params, groups, threads = _C.mla_rope_pool_metal_plan(*args, inplace, q_rot, k_pe_rot)
    if groups:
        block = torch.frombuffer(bytearray(params), dtype=torch.uint8).to(q.device)
        # a combined cache: k_pe's values follow kv_c's in each row
        kpe = kpe_cache if kpe_cache is not None else kv_cache[..., kv_c.shape[1] :]
        # buffers the kernel never reads (no table, no weight, the other dtype's slot) take any tensor
        table = cos_sin_cache if cos_sin_cache is not None else positions
        w = weight if weight is not None else q
        w32, w_t = (w, q) if w.dtype == torch.float32 else (q, w)
        kernel = getattr(_library(), "mla_" + _KERNELS[q.dtype])
        kernel(
            q,
            kv_c,
            k_pe,
            q_rot,
            k_pe_rot,
            kv_cache,
            kpe,
            positions,
            slots,
            table,
            table,
            block,
            w32,
            w_t,
            threads=groups * threads,
            group_size=threads,
        )
    return q_rot, k_pe_rot, kv_cache, kpe_cache


_TOKEN_NORM_KERNELS = {
    torch.float16: "token_rms_norm_half",
    torch.bfloat16: "token_rms_norm_bfloat",
    torch.float32: "token_rms_norm_float",
}


def token_rms_norm(x, weight, eps, offset, out):
    """qk_norm_rope's per-token QK norm on Apple GPUs (src/metal/token_rms_norm.metal), into ``out``."""
    params, groups, threads = _C._qk_token_rms_norm_metal_plan(x, weight, eps, offset, out)
    if groups:
        block = torch.frombuffer(bytearray(params), dtype=torch.uint8).to(x.device)
        # the weight fills its dtype's slot; the kernel never reads the other one
        w32, w_t = (weight, x) if weight.dtype == torch.float32 else (x, weight)
        kernel = getattr(_library("token_rms_norm"), _TOKEN_NORM_KERNELS[x.dtype])
        kernel(x, w32, w_t, out, block, threads=groups * threads, group_size=threads)
