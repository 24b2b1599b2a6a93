import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
requires_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)


def poison_like(shape, dtype, device):
    """A tensor of random bytes (never zeros), so unwritten outputs show."""
    t = torch.empty(shape, dtype=dtype, device=device)
    b = t.view(torch.uint8) if t.numel() else t
    if t.numel():
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device=device))
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality for any dtype (fp8 included, NaN payloads included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a = a.contiguous()
    b = b.contiguous()
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
