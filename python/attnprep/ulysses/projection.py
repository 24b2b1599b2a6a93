"""The pack-free input side: q, k and v projection weights rearranged once so
that one batched GEMM writes the destination-major send buffer."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .agreement import _check_geometry, _checked_chunks, _saturated, _world
from .exchange import _Pending, _unpack

Tensor = torch.Tensor


def destination_major_qkv_weight(
    w_q: Tensor,
    w_k: Tensor,
    w_v: Tensor,
    world_size: int,
    head_dim: int,
    b_q: Optional[Tensor] = None,
    b_k: Optional[Tensor] = None,
    b_v: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """The q, k, v projection weights (``nn.Linear`` layout) rearranged once so
    that one batched GEMM writes the destination-major send buffer.

    Returns ``(weight [W, n, hidden], bias [W, n] or None)``; row block d
    holds destination d's rows: per head q | k | v for MHA (the layout of
    pack_qkv_destination_major), q heads then kv heads then v heads for GQA
    (the layer's grouped layout). docs/contract.md has the details."""
    if not (
        all(isinstance(w, Tensor) and w.dim() == 2 for w in (w_q, w_k, w_v))
        and w_q.shape[1] == w_k.shape[1] == w_v.shape[1]
        and w_q.dtype == w_k.dtype == w_v.dtype
    ):
        raise ValueError(
            "ulysses: w_q, w_k and w_v must be 2-D [heads * head_dim, hidden] with one hidden size and dtype"
        )
    if not (isinstance(head_dim, int) and head_dim > 0 and all(w.shape[0] % head_dim == 0 for w in (w_q, w_k, w_v))):
        raise ValueError("ulysses: head_dim must be positive and divide the rows of w_q, w_k and w_v")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"ulysses: world_size must be an int, got {type(world_size).__name__}")
    heads, kv = w_q.shape[0] // head_dim, w_k.shape[0] // head_dim
    meta = lambda n: torch.empty(1, n, head_dim, device="meta")  # noqa: E731  (the geometry checks, no data)
    _check_geometry(meta(heads), meta(kv), meta(w_v.shape[0] // head_dim), _saturated(world_size))
    biases = (b_q, b_k, b_v)
    if any(b is not None for b in biases) and not all(
        isinstance(b, Tensor) and b.shape == (w.shape[0],) for b, w in zip(biases, (w_q, w_k, w_v))
    ):
        raise ValueError("ulysses: b_q, b_k and b_v must be given together, each [heads * head_dim] of its weight")

    # heads as rows of [heads, head_dim, hidden] (bias: [heads, head_dim]); the
    # same head selection builds the weight and the bias
    def per_head(t, n):
        return t.reshape(n, head_dim, -1)

    def destination(parts_q, parts_k, parts_v, d):
        local_q = heads // world_size
        qs = list(range(d * local_q, (d + 1) * local_q))
        if kv == heads:  # MHA: per head q | k | v
            return torch.cat([torch.stack([parts_q[h], parts_k[h], parts_v[h]]) for h in qs]).reshape(
                -1, parts_q.shape[-1]
            )
        if kv >= world_size:
            ks = list(range(d * (kv // world_size), (d + 1) * (kv // world_size)))
        else:
            ks = [qs[0] // (heads // kv)]
        return torch.cat([parts_q[qs], parts_k[ks], parts_v[ks]]).reshape(-1, parts_q.shape[-1])

    pq, pk, pv = per_head(w_q, heads), per_head(w_k, kv), per_head(w_v, kv)
    weight = torch.stack([destination(pq, pk, pv, d) for d in range(world_size)]).contiguous()
    bias = None
    if b_q is not None:
        bq, bk, bv = (b.reshape(-1, head_dim, 1) for b in biases)
        bias = torch.stack([destination(bq, bk, bv, d)[:, 0] for d in range(world_size)]).contiguous()
    return weight, bias


def project_destination_major(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x [rows, hidden]`` -> the send buffer ``[W, rows, n]``, one batched GEMM."""
    if not (isinstance(x, Tensor) and x.dim() == 2 and x.shape[1] == weight.shape[2] and x.dtype == weight.dtype):
        raise ValueError("ulysses: x must be [rows, hidden] with the weight's hidden size and dtype")
    if bias is None:
        return torch.matmul(x, weight.transpose(1, 2))
    return torch.baddbmm(bias[:, None, :], x.expand(weight.shape[0], *x.shape), weight.transpose(1, 2))


class UlyssesQKVProjection(torch.nn.Module):
    """The q, k, v projection of a Ulysses layer that writes the send buffer
    directly (no pack pass), then exchanges it: ``forward(x)`` returns what
    :func:`scatter_heads` returns for the projected q, k, v."""

    def __init__(
        self,
        weight: Tensor,
        bias: Optional[Tensor],
        heads: int,
        kv_heads: int,
        head_dim: int,
        group=None,
        validate: bool = True,
    ):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        self.heads, self.kv_heads, self.head_dim, self.group, self.validate = heads, kv_heads, head_dim, group, validate

    @classmethod
    def from_weights(cls, w_q, w_k, w_v, world_size, head_dim, b_q=None, b_k=None, b_v=None, group=None, validate=True):
        weight, bias = destination_major_qkv_weight(w_q, w_k, w_v, world_size, head_dim, b_q, b_k, b_v)
        return cls(weight, bias, w_q.shape[0] // head_dim, w_k.shape[0] // head_dim, head_dim, group, validate)

    def forward(self, x: Tensor, async_op: bool = False):
        world, _ = _world(self.group)
        if self.weight.shape[0] != world:
            raise ValueError(
                f"ulysses: the weights were arranged for {self.weight.shape[0]} ranks, the group has {world}"
            )
        if self.validate:
            # the ranks agree on rows, heads, head_dim and dtype, as scatter_heads does (metadata only)
            grad = isinstance(x, Tensor) and x.requires_grad
            rows = x.shape[0] if isinstance(x, Tensor) and x.dim() == 2 else -1
            q, k, v = (
                torch.empty(
                    max(rows, 0),
                    n,
                    self.head_dim,
                    device="meta",
                    dtype=x.dtype if isinstance(x, Tensor) else torch.float32,
                    requires_grad=grad,
                )
                for n in (self.heads, self.kv_heads, self.kv_heads)
            )
            _checked_chunks(q, k, v, self.group, True)
        send = project_destination_major(x, self.weight, self.bias)
        if self.heads == self.kv_heads:
            send = send.view(world, x.shape[0], self.heads // world, 3 * self.head_dim)
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=async_op) if world > 1 else None
        if world == 1:
            recv = send
        finish = lambda: _unpack(recv, self.heads, self.kv_heads, self.head_dim, world)  # noqa: E731
        return _Pending(work, finish) if async_op else finish()
