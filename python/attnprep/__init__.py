"""attnprep: hand-written CUDA and Metal kernels for the memory-bound steps
between a transformer's QKV projection and its attention.

Public ops (each function's docstring gives its parameters, returns and errors):

- :func:`pack_qkv_destination_major`: Ulysses input side, one all-to-all.
- :func:`usp_merge_heads`: Ulysses output side.
- :func:`rope_pool_fused`: RoPE on q/k (after an optional QK RMSNorm) and the
  KV-pool write, one launch.
- :func:`qk_norm_rope`: the same without a KV cache, for [T, H, D] or [B, S, H, D]
  q and k (diffusion transformers, encoders).
- :func:`mla_rope_pool_fused`: multi-head latent attention's RoPE, kv_c norm and
  latent-cache write (DeepSeek-V3), one launch.
- :func:`rope_cos_sin_cache`: a model's RoPE table (every scaling scheme) for it.
- :func:`rope_cos_sin_rows`: a model's precomputed per-token cos/sin as rows for it.
- :func:`rope_kwargs_from_config`: rope_pool_fused's arguments from a transformers config.
- :mod:`attnprep.ulysses`: Ulysses attention over torch.distributed.
- :mod:`attnprep.testing`: the float64 references the ops are checked against.

The contract (every argument's semantics, every error message in order, the
accuracy, what is verified where) ships with the package as ``contract.md``:
``importlib.resources.files("attnprep") / "contract.md"``.
"""

__version__ = "0.1.0"

from ._info import build_info
from .mla_rope_pool import mla_rope_pool_fused
from .pack_qkv import pack_qkv_destination_major
from .qk_norm_rope import qk_norm_rope
from .rope_config import rope_kwargs_from_config
from .rope_pool import rope_pool_fused
from .rope_tables import rope_cos_sin_cache, rope_cos_sin_rows
from .usp_merge_heads import usp_merge_heads

__all__ = [
    "__version__",
    "build_info",
    "pack_qkv_destination_major",
    "usp_merge_heads",
    "rope_pool_fused",
    "qk_norm_rope",
    "mla_rope_pool_fused",
    "rope_cos_sin_cache",
    "rope_kwargs_from_config",
    "rope_cos_sin_rows",
]
