"""When to call the extension directly and when to go through torch's dispatcher.

Eager calls on plain tensors go straight to the nanobind function: the
dispatcher adds microseconds per call to an op that is meant to cost a
kernel launch. Anything torch is tracing (torch.compile, FakeTensor, tensor
subclasses) goes through the registered op (``_ops``), whose fake kernel
checks the metadata and gives the output's.
"""

from __future__ import annotations

import torch

_is_compiling = torch.compiler.is_compiling
_Tensor = torch.Tensor


def direct(*tensors) -> bool:
    if _is_compiling():
        return False
    for t in tensors:
        if t.__class__ is _Tensor:
            # A lazily negated or conjugated view: its memory is not its
            # values; the dispatcher resolves it (DLPack would export the raw
            # memory as if it were the values).
            if t.is_neg() or t.is_conj():
                return False
        elif isinstance(t, _Tensor):
            # Subclasses (FakeTensor, functional tensors...) need the
            # dispatcher; anything that is no tensor at all gets the
            # extension's TypeError.
            return False
    return True
