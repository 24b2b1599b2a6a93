"""Build and runtime information."""

from __future__ import annotations

import torch

from . import _C


def build_info() -> dict:
    """What this installation was built with and what it runs on.

    Keys: version, cuda (bool), cuda_version, cuda_architectures, metal (bool),
    dlpack_path ("exchange-api": torch's C-level DLPack exchange table, about
    0.1 us per tensor; "dlpack-fallback": ``__dlpack__``, a few us per tensor),
    torch, device (what the current process can use).
    """
    info = dict(_C._build_info())
    info["torch"] = torch.__version__
    if torch.cuda.is_available():
        info["device"] = f"cuda:{torch.cuda.current_device()} ({torch.cuda.get_device_name()})"
    elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        info["device"] = "mps"
    else:
        info["device"] = "cpu only"
    return info
