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
        # Subclasses (FakeTensor, functional tensors...) need the dispatcher;
        # anything that is no tensor at all gets the extension's TypeError.
        if t.__class__ is not _Tensor and isinstance(t, _Tensor):
            return False
    return True
