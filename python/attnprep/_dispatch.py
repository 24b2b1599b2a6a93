"""When to call the extension directly and when to go through torch's dispatcher.

Eager calls on plain tensors go straight to the nanobind function: the
dispatcher adds microseconds per call to an op that is meant to cost a
kernel launch. Anything torch is tracing (torch.compile, FakeTensor, tensor
subclasses) goes through the registered op (``_ops``), whose fake kernel
checks the metadata and gives the output's.
"""

from __future__ import annotations

import math
import numbers
import operator

import torch

_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_Tensor = torch.Tensor

INFERENCE_ONLY = "{op}: the op is inference-only; its tensors must not require grad (use torch.no_grad())"


def direct(*tensors) -> bool:
    if _is_compiling():
        return False
    for t in tensors:
        if t.__class__ is _Tensor:
            # A lazily negated or conjugated view's memory is not its values (the dispatcher resolves it); a tensor
            # that requires grad in grad mode is refused on the other path (refuse_grad).
            if t.is_neg() or t.is_conj() or (t.requires_grad and _grad_enabled()):
                return False
        elif isinstance(t, _Tensor):
            # Subclasses (FakeTensor, functional tensors...) need the
            # dispatcher; anything that is no tensor at all gets the
            # extension's TypeError.
            return False
    return True


def refuse_grad(op: str, *tensors) -> None:
    """The ops have no backward: in grad mode, a tensor argument that requires
    grad is refused (docs/contract.md), the same on every device and path."""
    if _grad_enabled() and any(isinstance(t, _Tensor) and t.requires_grad for t in tensors):
        raise ValueError(INFERENCE_ONLY.format(op=op))


# The extension's readings of the non-tensor arguments (src/bindings/tensor_import.cpp), for dispatcher calls:
# torch's schema would otherwise take a bool for an int, give a str torch's RuntimeError and not carry an int past
# int64. Values torch traces symbolically pass through.
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def tensor_arg(x, name: str, optional: bool = False):
    if not (isinstance(x, _Tensor) or (optional and x is None)):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _number(x, abc) -> bool:
    """A numbers.Integral / numbers.Real (Python's and numpy's scalars), not a
    bool (numpy's is no number) and not a tensor."""
    return not isinstance(x, (bool, _Tensor)) and isinstance(x, abc)


def int_arg(x, op: str, name: str, past_int64=None):
    """An int (a numbers.Integral but a bool); outside int64 it becomes
    ``past_int64`` when given, else saturates, for the op's range check."""
    if isinstance(x, _SYMBOLIC):
        return x
    if not _number(x, numbers.Integral):
        raise TypeError(f"{op}: {name} must be an int, got {type(x).__name__}")
    x = operator.index(x)
    if -(2**63) <= x < 2**63:
        return x
    if past_int64 is not None:
        return past_int64
    return 2**63 - 1 if x > 0 else -(2**63)


def float_arg(x, op: str, name: str):
    """A numbers.Real (not a bool, not a tensor); an int past float's range is infinite."""
    if isinstance(x, _SYMBOLIC):
        return x
    if not _number(x, numbers.Real):
        raise TypeError(f"{op}: {name} must be a number, got {type(x).__name__}")
    try:
        return float(operator.index(x) if isinstance(x, numbers.Integral) else x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def bool_arg(x, op: str, name: str):
    if isinstance(x, _SYMBOLIC):
        return x
    if not isinstance(x, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {type(x).__name__}")
    return x
