"""Every documented ValueError keeps its exact text and carries the offending
values as a PEP 678 note (``__notes__``, shown in the traceback): dtypes and
devices for the checks on them, expected and given shapes for the shape
checks. The same note eagerly, through the dispatcher (FakeTensors) and as
the root cause under torch.compile."""

import sys
import traceback

import attnprep
import pytest
import torch
from test_compile_tracing import compiled, root_cause
from torch._subclasses.fake_tensor import FakeTensorMode

KW = dict(head_dim=64, num_qo_heads=8, num_kv_heads=2, rope_base=1e4)


def rope_call(device, q_dtype=torch.float32, k_dtype=torch.float32, q_heads=8):
    q = torch.randn(4, q_heads, 64, device=device, dtype=q_dtype)
    k = torch.randn(4, 2, 64, device=device, dtype=k_dtype)
    v = torch.randn(4, 2, 64, device=device, dtype=q_dtype)
    pos = torch.arange(4, device=device)
    pool = torch.zeros(16, 2, 64, device=device, dtype=q_dtype)
    return lambda: attnprep.rope_pool_fused(q, k, v, pos, pos, pool, pool.clone(), **KW)


def pack_call(device, dtypes=(torch.float32,) * 3, shapes=((4, 8, 16),) * 3):
    q, k, v = (torch.randn(s, device=device, dtype=d) for s, d in zip(shapes, dtypes))
    return lambda: attnprep.pack_qkv_destination_major(q, k, v, 2)


def raised(fn):
    with pytest.raises(Exception) as e:
        fn()
    return root_cause(e.value)


def check(cause, msg, note):
    assert type(cause) is ValueError and str(cause) == msg, repr(cause)
    assert getattr(cause, "__notes__", None) == [note]
    if sys.version_info >= (3, 11):
        assert note in "".join(traceback.format_exception(cause))


def on_every_path(make, msg, note_cpu, note_cuda):
    check(raised(make("cpu")), msg, note_cpu)
    check(raised(compiled(lambda: make("cpu")())), msg, note_cpu)
    with FakeTensorMode():
        check(raised(make("cuda")), msg, note_cuda)


def test_rope_dtype_check_names_each_tensor():
    def make(device):
        return rope_call(device, q_dtype=torch.bfloat16, k_dtype=torch.float16)

    note = "q: torch.bfloat16 on {d}, k: torch.float16 on {d}, v: torch.bfloat16 on {d}"
    on_every_path(make, "q/k/v dtypes must match", note.format(d="cpu"), note.format(d="cuda:0"))


def test_rope_shape_check_gives_expected_and_given_shape():
    def make(device):
        return rope_call(device, q_heads=6)

    msg = "q shape must be [num_tokens, num_qo_heads, head_dim], got torch.Size([4, 6, 64])"
    note = "expected [4, 8, 64], got torch.Size([4, 6, 64])"
    on_every_path(make, msg, note, note)


def test_pack_shape_check_names_each_shape():
    def make(device):
        return pack_call(device, shapes=((4, 8, 16), (4, 8, 16), (5, 8, 16)))

    note = "q: torch.Size([4, 8, 16]), k: torch.Size([4, 8, 16]), v: torch.Size([5, 8, 16])"
    on_every_path(make, "q, k, and v must have the same 3D shape", note, note)


def test_pack_device_and_dtype_checks_name_each_tensor():
    dtypes = (torch.float32, torch.float16, torch.float32)
    note = "q: torch.float32 on {d}, k: torch.float16 on {d}, v: torch.float32 on {d}"
    # on the CPU the device check comes first; on (fake) CUDA tensors the dtype check
    check(raised(pack_call("cpu", dtypes)), "q, k, and v must be CUDA tensors", note.format(d="cpu"))
    with FakeTensorMode():
        check(
            raised(pack_call("cuda", dtypes)),
            "q, k, and v must have the same device and dtype",
            note.format(d="cuda:0"),
        )


def test_world_size_check_gives_both_numbers():
    with FakeTensorMode():
        q = torch.randn(4, 8, 16, device="cuda")
        cause = raised(lambda: attnprep.pack_qkv_destination_major(q, q, q, 3))
    check(cause, "world_size must be positive and divide global_heads", "world_size: 3, global_heads: 8")
