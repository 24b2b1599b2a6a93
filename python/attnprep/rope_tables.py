"""rope_cos_sin_cache: a model's RoPE table for ``rope_pool_fused(cos_sin_cache=...)``.

Built the way Hugging Face transformers builds a model's rotary embedding
(its RoPE initialisation functions, then ``cos(position * inv_freq) *
attention_factor`` in float32), so the kernel applies exactly the model's
table. docs/contract.md has the contract; the tests compare against
transformers' own rotary embedding modules.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from numbers import Real
from typing import Optional, Tuple

import torch

Tensor = torch.Tensor

_SCHEMES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def _need(kind: str, cfg: dict, key: str):
    if cfg.get(key) is None:
        raise ValueError(f"rope_cos_sin_cache: {kind} scaling needs {key}")
    return cfg[key]


def _is_positive(value) -> bool:
    if not isinstance(value, Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:  # an int past float's range: not finite as the formulas use it
        return False


def _positive(name: str, value):
    """``value``, refused unless a positive finite number: the schemes'
    formulas divide by these numbers or take their logs, and would return a
    table of NaN or a ZeroDivisionError instead."""
    if not _is_positive(value):
        raise ValueError(f"rope_cos_sin_cache: {name} must be a positive finite number, got {value!r}")
    return value


def _number(kind: str, cfg: dict, key: str):
    """A key the scheme needs: present, and a positive finite number."""
    return _positive(f"{kind} scaling's {key}", _need(kind, cfg, key))


def _optional(kind: str, cfg: dict, key: str, zero_is_default: bool = False):
    """A key the scheme may go without: None where it is missing (or 0, for
    the keys the model's code reads with ``or``), else a positive finite
    number."""
    value = cfg.get(key)
    if value is None or (zero_is_default and isinstance(value, Real) and value == 0):
        return None
    return _positive(f"{kind} scaling's {key}", value)


def _above_one(kind: str, name: str, value):
    """A number whose log the scheme divides by."""
    if not value > 1:
        raise ValueError(f"rope_cos_sin_cache: {kind} scaling needs {name} > 1, got {value!r}")
    return value


def _context(kind: str, max_position_embeddings):
    """The model's context length, where a scheme needs it."""
    _need(kind, {"max_position_embeddings": max_position_embeddings}, "max_position_embeddings")
    return _positive("max_position_embeddings", max_position_embeddings)


def _plain(base: float, dim: int) -> Tensor:
    # float32 pow of float32 exponents, as the models compute it
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _yarn(cfg: dict, base: float, dim: int, max_position_embeddings: Optional[int]) -> Tuple[Tensor, float]:
    original = _number("yarn", cfg, "original_max_position_embeddings")
    factor = _optional("yarn", cfg, "factor")
    if factor is None:
        factor = _context("yarn", max_position_embeddings) / original

    def mscale_of(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = _optional("yarn", cfg, "attention_factor")
    if attention is None:
        m, m_all = (_optional("yarn", cfg, key, zero_is_default=True) for key in ("mscale", "mscale_all_dim"))
        attention = float(mscale_of(factor, m) / mscale_of(factor, m_all)) if m and m_all else mscale_of(factor)
    beta_fast = _optional("yarn", cfg, "beta_fast", zero_is_default=True) or 32
    beta_slow = _optional("yarn", cfg, "beta_slow", zero_is_default=True) or 1
    _above_one("yarn", "base", base)

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if cfg.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, attention


def _llama3(cfg: dict, base: float, dim: int) -> Tensor:
    inv = _plain(base, dim)
    factor = _number("llama3", cfg, "factor")
    low_factor = _number("llama3", cfg, "low_freq_factor")
    high_factor = _number("llama3", cfg, "high_freq_factor")
    context = _number("llama3", cfg, "original_max_position_embeddings")
    low_wavelen, high_wavelen = context / low_factor, context / high_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (context / wavelen - low_factor) / (high_factor - low_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _factors(cfg: dict, key: str, dim: int) -> list:
    """longrope's per-frequency factors: rotary_dim / 2 positive numbers."""
    values = _need("longrope", cfg, key)
    n = dim // 2
    if (
        isinstance(values, (str, bytes))
        or not hasattr(values, "__len__")
        or len(values) != n
        or not all(_is_positive(x) for x in values)
    ):
        raise ValueError(
            f"rope_cos_sin_cache: longrope scaling's {key} must hold rotary_dim / 2 = {n} positive finite numbers"
        )
    return list(values)


def _longrope(
    cfg: dict, base: float, dim: int, seq_len: int, max_position_embeddings: Optional[int]
) -> Tuple[Tensor, float]:
    original = _number("longrope", cfg, "original_max_position_embeddings")
    long_factor = _factors(cfg, "long_factor", dim)
    short_factor = _factors(cfg, "short_factor", dim)
    factor = _optional("longrope", cfg, "factor")
    if factor is None:
        factor = _context("longrope", max_position_embeddings) / original
    attention = _optional("longrope", cfg, "attention_factor")
    if attention is None:
        attention = (
            1.0
            if factor <= 1.0
            else math.sqrt(
                1 + math.log(factor) / math.log(_above_one("longrope", "original_max_position_embeddings", original))
            )
        )
    ext = torch.tensor(long_factor if seq_len > original else short_factor, dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * base**shape), attention


def rope_inv_freq(
    head_dim: int,
    base: float,
    *,
    rotary_dim: Optional[int] = None,
    scaling: Optional[dict] = None,
    max_position_embeddings: Optional[int] = None,
    seq_len: int = 0,
    max_position: int = 1,
    dtype: torch.dtype = torch.float32,
) -> Tuple[Tensor, float]:
    """(inv_freq ``[rotary_dim / 2]`` float32, attention factor) of a RoPE scheme,
    whose ``[max_position, rotary_dim]`` table of ``dtype`` must be describable."""
    if scaling is not None and not isinstance(scaling, Mapping):
        raise ValueError(f"rope_cos_sin_cache: scaling must be a dict or None, got {type(scaling).__name__}")
    cfg = dict(scaling or {})
    kind = cfg.get("rope_type", cfg.get("type")) or "default"
    if kind not in _SCHEMES:
        raise ValueError(f"rope_cos_sin_cache: unknown rope scaling type {kind}")
    partial = _optional(kind, cfg, "partial_rotary_factor")
    dim = rotary_dim if rotary_dim is not None else head_dim if partial is None else int(head_dim * partial)
    if not (isinstance(dim, int) and 2 <= dim <= head_dim and dim % 2 == 0):
        raise ValueError(f"rope_cos_sin_cache: rotary_dim must be even and in [2, head_dim], got {dim}")
    if max_position * dim * dtype.itemsize > 2**63 - 1:
        raise ValueError(
            f"rope_cos_sin_cache: the table would exceed 2^63 - 1 bytes ([max_position, rotary_dim] = "
            f"[{max_position}, {dim}] of {dtype})"
        )
    _positive("base", base)
    if kind == "default":
        return _plain(base, dim), 1.0
    if kind == "linear":
        return _plain(base, dim) / _number(kind, cfg, "factor"), 1.0
    if kind == "dynamic":
        factor = _number(kind, cfg, "factor")
        context = _context(kind, max_position_embeddings)
        if dim < 4:
            raise ValueError(f"rope_cos_sin_cache: dynamic scaling needs rotary_dim >= 4, got {dim}")
        length = max(seq_len, context)
        return _plain(base * ((factor * length / context) - (factor - 1)) ** (dim / (dim - 2)), dim), 1.0
    if kind == "yarn":
        return _yarn(cfg, base, dim, max_position_embeddings)
    if kind == "llama3":
        return _llama3(cfg, base, dim), 1.0
    return _longrope(cfg, base, dim, seq_len, max_position_embeddings)


def _int(name: str, value):
    """An int argument (None where optional), as the ops take one: anything
    with ``__index__`` (numpy's ints too), not a bool or a float."""
    if value is None:
        return None
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"rope_cos_sin_cache: {name} must be an int, got {type(value).__name__}")
    return operator.index(value)


def rope_cos_sin_cache(
    head_dim: int,
    max_position: int,
    base: float,
    *,
    rotary_dim: Optional[int] = None,
    scaling: Optional[dict] = None,
    max_position_embeddings: Optional[int] = None,
    seq_len: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> Tensor:
    """A model's RoPE table, as transformers builds it, for ``rope_pool_fused(cos_sin_cache=...)``.

    Parameters
    ----------
    head_dim : int
        The attention head size.
    max_position : int
        Rows of the table (positions ``0 .. max_position - 1``).
    base : float
        The config's ``rope_theta``.
    rotary_dim : int, optional
        The rotated part of each head (default ``head_dim``).
    scaling : dict, optional
        The config's RoPE dict (``rope_scaling`` or ``rope_parameters``):
        none, ``linear``, ``dynamic``, ``yarn``, ``llama3`` or ``longrope``.
    max_position_embeddings : int, optional
        The model's context length (needed by ``dynamic``, and by
        ``yarn``/``longrope`` without a ``factor``).
    seq_len : int, optional
        The sequence length ``dynamic`` and ``longrope`` adapt to (default
        ``max_position``).
    dtype : torch.dtype
        float32 (default) or bfloat16.
    device : torch.device or str, optional
        Where the table is built.

    Returns
    -------
    torch.Tensor
        ``[max_position, rotary_dim]``: the cos of every position's angles,
        then their sin (the scheme's attention factor applied to both).

    Raises
    ------
    TypeError
        An int argument of another type (``"rope_cos_sin_cache: head_dim must
        be an int, got float"``).
    ValueError
        A scheme it does not know, a missing or invalid key, with the
        messages of the contract (``contract.md`` in the package).

    Examples
    --------
    >>> llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    ...           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    >>> table = rope_cos_sin_cache(128, 131072, 500000.0, scaling=llama3)
    >>> table.shape, table.dtype
    (torch.Size([131072, 128]), torch.float32)
    >>> bool(table[0, :64].eq(1).all())
    True
    """
    head_dim, max_position, rotary_dim, seq_len = (
        _int(name, value)
        for name, value in (
            ("head_dim", head_dim),
            ("max_position", max_position),
            ("rotary_dim", rotary_dim),
            ("seq_len", seq_len),
        )
    )
    if max_position <= 0:
        raise ValueError(f"rope_cos_sin_cache: max_position must be positive, got {max_position}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"rope_cos_sin_cache: dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    inv, attention = rope_inv_freq(
        head_dim,
        base,
        rotary_dim=rotary_dim,
        scaling=scaling,
        max_position_embeddings=max_position_embeddings,
        seq_len=max_position if seq_len is None else seq_len,
        max_position=max_position,
        dtype=dtype,
    )
    # Values each in range can still overflow the table (a base of 1e-300, yarn's mscale of 1e308): the largest angle
    # and the attention factor, formed in float32 as the table forms them, must be finite; then so is every entry.
    inv = inv.float()
    last = torch.tensor(float(max_position - 1), dtype=torch.float32) * inv.max()
    if not (bool(torch.isfinite(last)) and bool(torch.isfinite(torch.tensor(attention, dtype=torch.float32)))):
        raise ValueError(
            f"rope_cos_sin_cache: the table would not be finite in float32 (position "
            f"{max_position - 1} * inv_freq {float(inv.max())!r}, attention factor {attention!r})"
        )
    angle = torch.arange(max_position, dtype=torch.float32)[:, None] * inv[None, :]
    table = torch.cat([angle.cos() * attention, angle.sin() * attention], dim=1)
    return table.to(dtype=dtype, device=device)


_PAIRS = ("adjacent", "halves")


def rope_cos_sin_rows(cos: Tensor, sin: Optional[Tensor] = None, *, pairs: str = "adjacent", check: bool = True):
    """A model's precomputed per-token cos/sin as the rows ``rope_pool_fused(positions=None, cos_sin_cache=...)`` reads.

    Parameters
    ----------
    cos : torch.Tensor
        ``[S, D]`` real cos with each frequency repeated per rotation pair
        (diffusers' ``use_real=True`` form), or ``[S, D / 2]`` complex
        ``freqs_cis`` (``cos + i sin``; then ``sin`` is None and the pairs
        are adjacent).
    sin : torch.Tensor, optional
        ``[S, D]``, repeated as ``cos`` is.
    pairs : str
        How the real form repeats a frequency: ``"adjacent"`` (elements 2i
        and 2i + 1, diffusers' ``repeat_interleave_real=True``; rotate with
        ``is_neox=False``) or ``"halves"`` (i and i + D / 2; ``is_neox=True``).
    check : bool
        Compare the repeated elements (one host synchronisation; pass False
        inside CUDA-graph capture).

    Returns
    -------
    torch.Tensor
        ``[S, D]`` float32 (bfloat16 kept): the cosines of the D / 2
        frequencies, then their sines.

    Raises
    ------
    ValueError
        ``rope_cos_sin_rows: ...`` for shapes that do not pair up, an unknown
        ``pairs``, or (with ``check``) a cos or sin not repeated as ``pairs`` says.

    Examples
    --------
    >>> freqs = torch.outer(torch.arange(4.0), torch.tensor([1.0, 0.1]))  # [S, D / 2] angles
    >>> cos = freqs.cos().repeat_interleave(2, dim=1)
    >>> sin = freqs.sin().repeat_interleave(2, dim=1)
    >>> rows = rope_cos_sin_rows(cos, sin)
    >>> torch.equal(rows, torch.cat([freqs.cos(), freqs.sin()], 1))
    True
    >>> torch.allclose(rope_cos_sin_rows(torch.polar(torch.ones_like(freqs), freqs)), rows, atol=1e-6)
    True
    """
    if pairs not in _PAIRS:
        raise ValueError(f'rope_cos_sin_rows: pairs must be "adjacent" or "halves", got {pairs}')
    if cos.is_complex():
        if sin is not None or cos.dim() != 2:
            raise ValueError("rope_cos_sin_rows: complex freqs_cis must be [S, D / 2], with sin=None")
        return torch.cat([cos.real, cos.imag], dim=1).float()
    if sin is None or cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] % 2:
        raise ValueError("rope_cos_sin_rows: cos and sin must both be [S, D] with D even")
    half = cos.shape[1] // 2
    first = (lambda t: t[:, 0::2]) if pairs == "adjacent" else (lambda t: t[:, :half])
    second = (lambda t: t[:, 1::2]) if pairs == "adjacent" else (lambda t: t[:, half:])
    if check and not all(torch.equal(first(t), second(t)) for t in (cos, sin)):
        raise ValueError(f'rope_cos_sin_rows: cos and sin are not repeated per pair as pairs="{pairs}" says')
    rows = torch.cat([first(cos), first(sin)], dim=1)
    return rows if rows.dtype in (torch.float32, torch.bfloat16) else rows.float()
