"""rope_pool_fused on Apple GPUs: the op's kernel for the MPS device.

The kernel is src/metal/rope_pool.metal (shipped in the package as
attnprep/metal/). It runs through torch's shader-library API
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
from ._ops import RopeArgs

_KERNELS = {torch.float16: "rope_pool_half", torch.bfloat16: "rope_pool_bfloat", torch.float32: "rope_pool_float"}


def source() -> str:
    """The kernel source with its parameter header inlined (one compile unit)."""
    here = resources.files("attnprep") / "metal"
    text = (here / "rope_pool.metal").read_text()
    header = (here / "rope_pool_params.h").read_text()
    return text.replace('#include "rope_pool_params.h"', header)


@functools.lru_cache(maxsize=None)
def _library():
    return torch.mps.compile_shader(source())


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
