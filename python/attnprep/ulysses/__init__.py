"""Ulysses sequence parallelism on torch.distributed.

Each rank holds a shard of the sequence, ``[rows, heads, head_dim]``. The
layer exchanges heads for sequence with ONE all_to_all_single on the input
side (q, k and v packed together by :func:`pack_qkv_destination_major`, or
its grouped-query variant), runs attention over the whole sequence with the
rank's share of the heads, and exchanges back with one all_to_all_single and
:func:`usp_merge_heads`. The result equals attention over the whole sequence
on one device, sliced to the rank's rows.

Works with NCCL on CUDA tensors and with gloo on CPU tensors (there the
packing and merging are done with plain torch; the public ops stay CUDA-only).

    import torch.distributed as dist
    from attnprep.ulysses import UlyssesAttention

    dist.init_process_group("nccl")
    layer = UlyssesAttention(causal=True)
    out = layer(q, k, v)          # q [rows, H, D], k/v [rows, H_kv, D] on this rank

Grouped-query attention: ``H_kv`` must divide ``H`` and either be a multiple
of the world size (each rank gets ``H_kv / W`` kv heads) or divide it (each
rank gets the one kv head its q heads use; replicated across ranks).

Ranks agree before any data moves: with ``validate=True`` (the default) one
small all_gather carries every rank's geometry and the verdict of its local
checks, so that a bad input on any rank, or ranks that disagree on rows,
heads, head_dim or dtype, make EVERY rank raise the same ValueError and none
waits in a collective (docs/contract.md lists the messages). The layer is for
inference: inputs that require grad, with grad mode on, are refused.
Any dtype works: the output side merges float16/bfloat16/float32 with
usp_merge_heads and other dtypes (float64, say) with torch's permute.
"""

from .agreement import (
    AUTO_CHUNKS,
    GATHER_SHAPE,
    INFERENCE_ONLY,
    LSE_NEEDS_ATTN_FN,
    LSE_NEEDS_ONE_CHUNK,
    MASK_NEEDS_BATCH,
    PROLOGUE_KEYS,
    PROLOGUE_NEEDS_BATCH,
    VALIDATE_IN_CAPTURE,
)
from .batched import sdpa_batched
from .exchange import gather_heads, scatter_heads
from .layer import AttnFn, UlyssesAttention, sdpa, ulysses_attention
from .projection import UlyssesQKVProjection, destination_major_qkv_weight, project_destination_major

__all__ = [
    "AUTO_CHUNKS",
    "GATHER_SHAPE",
    "INFERENCE_ONLY",
    "LSE_NEEDS_ATTN_FN",
    "LSE_NEEDS_ONE_CHUNK",
    "VALIDATE_IN_CAPTURE",
    "MASK_NEEDS_BATCH",
    "PROLOGUE_KEYS",
    "PROLOGUE_NEEDS_BATCH",
    "sdpa_batched",
    "AttnFn",
    "UlyssesAttention",
    "UlyssesQKVProjection",
    "destination_major_qkv_weight",
    "gather_heads",
    "project_destination_major",
    "scatter_heads",
    "sdpa",
    "ulysses_attention",
]
