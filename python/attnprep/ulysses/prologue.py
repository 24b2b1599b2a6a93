"""The batched layer's prologue: qk_norm_rope on the rank's q and k before the exchange, fused with the pack into
the send buffer where one kernel covers the arguments (CUDA, the one-chunk NCCL path, no padded heads), else
qk_norm_rope itself and the layer's own pack."""

from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import torch

from .. import _C
from ..qk_norm_rope import qk_norm_rope
from .agreement import _WIRE

Tensor = torch.Tensor


def _finite(x, positive: bool = False) -> bool:
    ok = isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
    return ok and (x > 0 or not positive)


TEXT_NORM_FORM = "ulysses: prologue's text_norm must be (rows, q_norm_weight, k_norm_weight), got {}"
TEXT_NORM_ROWS = "ulysses: prologue's text_norm rows must be in [0, {}], got {}"
TEXT_NORM_NEEDS = "ulysses: prologue's text_norm needs q_norm_weight and k_norm_weight"


def _text_norm(prologue: dict, rows: int) -> Tuple[int, Optional[Tensor], Optional[Tensor]]:
    """(text rows, q weight, k weight) of the prologue's text_norm (0, None, None without one), checked."""
    text = prologue.get("text_norm")
    if text is None:
        return 0, None, None
    form = isinstance(text, (tuple, list)) and len(text) == 3 and isinstance(text[0], numbers.Integral)
    if not (form and isinstance(text[1], Tensor) and isinstance(text[2], Tensor)):
        raise TypeError(TEXT_NORM_FORM.format(type(text).__name__))
    if isinstance(text[0], bool) or not 0 <= text[0] <= rows:
        raise ValueError(TEXT_NORM_ROWS.format(rows, text[0]))
    if prologue.get("q_norm_weight") is None or prologue.get("k_norm_weight") is None:
        raise ValueError(TEXT_NORM_NEEDS)
    return int(text[0]), text[1], text[2]


def _two_parts(q: Tensor, k: Tensor, prologue: dict, text: tuple) -> Tuple[Tensor, Tensor]:
    """qk_norm_rope on the text rows with the text weights and on the other rows with the prologue's, joined."""
    rows, qw, kw = text
    batch, s = q.shape[:2]
    rest = {key: value for key, value in prologue.items() if key != "text_norm"}
    table, positions = rest.get("cos_sin_cache"), rest.get("positions")
    parts = []
    for lo, hi, weights in ((0, rows, dict(q_norm_weight=qw, k_norm_weight=kw)), (rows, s, {})):
        kw_part = dict(rest, **weights)
        if positions is not None:  # [B, S] or M-RoPE's [3, B, S], flat forms included
            lead = positions.shape[:-1] if positions.shape[-1:] == (batch * s,) else positions.shape[:-2]
            kw_part["positions"] = positions.reshape(*lead, batch, s)[..., lo:hi]
        elif isinstance(table, Tensor) and table.dim() == 2 and table.shape[0] in (s, batch * s) and s > 0:
            shared = table.shape[0] == s
            kw_part["cos_sin_cache"] = table[lo:hi] if shared else table.view(batch, s, -1)[:, lo:hi].flatten(0, 1)
        parts.append(qk_norm_rope(q[:, lo:hi], k[:, lo:hi], **kw_part))
    return torch.cat([parts[0][0], parts[1][0]], dim=1), torch.cat([parts[0][1], parts[1][1]], dim=1)


def _fused_send(
    q: Tensor, k: Tensor, v: Tensor, prologue: dict, world: int, text: tuple, wire_dtype=None
) -> Optional[Tensor]:
    """The send buffer ``[world, S, B, n * D]`` (rows (s, b)), or with ``wire_dtype`` its fp8 wire rows ``[world, S,
    B, row_bytes]``, from one kernel; None where the kernel does not take these arguments (qk_norm_rope then runs,
    and raises its documented message for a bad one)."""
    table, eps = prologue.get("cos_sin_cache"), prologue.get("norm_eps", 1e-6)
    offset, rotary_dim = prologue.get("norm_weight_offset", 0.0), prologue.get("rotary_dim")
    if not (isinstance(table, Tensor) and _finite(eps, positive=True) and _finite(offset)):
        return None
    if prologue.get("mrope_section") is not None or prologue.get("mrope_interleaved", False) is not False:
        return None
    wire = None
    if wire_dtype is not None:
        B, S, H, D = q.shape
        n = H // world + 2 * (k.shape[2] // world if k.shape[2] >= world else 1)
        wire = torch.empty(world, S, B, _C._wire_row_bytes(n, D), dtype=torch.uint8, device=q.device)
    try:
        return _C._ulysses_send(
            q,
            k,
            v,
            world,
            prologue.get("q_norm_weight"),
            prologue.get("k_norm_weight"),
            float(eps),
            float(offset),
            table,
            prologue.get("positions"),
            q.shape[3] if rotary_dim is None else rotary_dim,
            prologue.get("is_neox", True),
            _WIRE[wire_dtype],
            wire,
            *text,
        )
    except (ValueError, TypeError):  # outside the kernel's reach (or a bad argument: qk_norm_rope names it)
        return None


def send_side(
    q: Tensor, k: Tensor, v: Tensor, prologue: dict, world: int, fused: bool, wire_dtype=None
) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """(q, k, send): the fused pass's send buffer (fp8 wire rows with ``wire_dtype``) where ``fused`` allows it and
    the kernel takes the arguments (q and k as given), else qk_norm_rope's q_rot and k_rot and no send buffer."""
    text = _text_norm(prologue, q.shape[1])
    send = _fused_send(q, k, v, prologue, world, text, wire_dtype) if fused else None
    if send is not None:
        return q, k, send
    if text[0] > 0:
        return (*_two_parts(q, k, prologue, text), None)
    q_rot, k_rot = qk_norm_rope(q, k, **{key: value for key, value in prologue.items() if key != "text_norm"})
    return q_rot, k_rot, None
