"""torch.compile(fullgraph=True) and FakeTensor tracing of every op, on any
machine. The fake kernels run the same C++ checks as the real ones on the
tensors' metadata, so a bad call fails while tracing with the documented
ValueError (dynamo wraps it; it is the root cause) and never with a shape
error; a good one traces with no graph break. Fake CUDA tensors need no GPU."""

import os
import subprocess
import sys

import attnprep
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


def root_cause(e: BaseException) -> BaseException:
    """The exception at the end of the chain (dynamo re-raises what a fake kernel raised)."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    return e


def expect(exc, msg, fn, *args, **kwargs):
    with pytest.raises(Exception) as e:
        fn(*args, **kwargs)
    cause = root_cause(e.value)
    assert type(cause) is exc and str(cause) == msg, repr(e.value)


ROPE_KW = dict(head_dim=64, num_qo_heads=8, num_kv_heads=2, rope_base=1e4)


def rope_args(device="cpu", T=4):
    return (
        torch.randn(T, 8, 64, device=device),
        torch.randn(T, 2, 64, device=device),
        torch.randn(T, 2, 64, device=device),
        torch.arange(T, device=device),
        torch.arange(T, device=device),
        torch.zeros(16, 2, 64, device=device),
        torch.zeros(16, 2, 64, device=device),
    )


def test_pack_qkv_traces_to_the_documented_error():
    def f(q, k, v):
        return attnprep.pack_qkv_destination_major(q * 2, k, v, 2) + 1

    def f_out(q, k, v, out):
        attnprep.pack_qkv_destination_major(q, k, v, 2, out=out)
        return out * 2

    q = torch.randn(5, 4, 8)
    expect(ValueError, "q, k, and v must be CUDA tensors", compiled(f), q, q, q)
    expect(ValueError, "q, k, and v must be CUDA tensors", compiled(f_out), q, q, q, torch.empty(2, 5, 2, 24))
    expect(ValueError, "q, k, and v must have the same 3D shape", compiled(f), q[0], q[0], q[0])


def test_usp_merge_heads_traces_to_the_documented_error():
    expect(
        ValueError,
        "usp_merge_heads expects a CUDA tensor",
        compiled(lambda x: attnprep.usp_merge_heads(x + 1)),
        torch.randn(2, 3, 1, 4, 8),
    )


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("check_slots", [False, True])
def test_rope_pool_traces_with_and_without_check_slots(inplace, check_slots):
    """check_slots is part of the op (its host check runs inside the real
    kernel), so it traces with fullgraph=True like any other argument."""

    def f(q, k, v, positions, slots, k_pool, v_pool):
        out = attnprep.rope_pool_fused(
            q * 1, k * 1, v, positions, slots, k_pool, v_pool, inplace=inplace, check_slots=check_slots, **ROPE_KW
        )
        return out[0] + 1, out[1].sum()

    expect(ValueError, "rope_pool_fused expects CUDA or MPS tensors", compiled(f), *rope_args())


def test_fake_kernels_give_shapes():
    with FakeTensorMode():
        q = torch.empty(5, 4, 8, device="cuda")
        assert attnprep.pack_qkv_destination_major(q, q, q, 2).shape == (2, 5, 2, 24)
        out = torch.empty(2, 5, 2, 24, device="cuda")
        assert attnprep.pack_qkv_destination_major(q, q, q, 2, out=out) is out
        assert attnprep.usp_merge_heads(torch.empty(2, 3, 1, 4, 8, device="cuda")).shape == (1, 3, 2, 4, 8)
        q_rot, k_rot, _, _ = attnprep.rope_pool_fused(*rope_args("cuda"), **ROPE_KW)
        assert q_rot.shape == (4, 8, 64) and k_rot.shape == (4, 2, 64)
        # check_slots needs the data, which fake tensors lack: the fake kernel skips it
        attnprep.rope_pool_fused(*rope_args("cuda"), check_slots=True, **ROPE_KW)


def test_fake_kernels_run_the_documented_checks():
    """What used to surface as 'negative dimension' or 'not enough values to unpack'."""
    with FakeTensorMode():
        q = torch.empty(5, 4, 8, device="cuda")
        flat = torch.empty(5, 32, device="cuda")
        for w in (-1, 0, 3):
            expect(
                ValueError,
                "world_size must be positive and divide global_heads",
                attnprep.pack_qkv_destination_major,
                q,
                q,
                q,
                w,
            )
        expect(
            ValueError,
            "q, k, and v must have the same 3D shape",
            attnprep.pack_qkv_destination_major,
            flat,
            flat,
            flat,
            2,
        )
        expect(
            ValueError,
            "out must be a contiguous tensor with the expected shape, device, and dtype",
            attnprep.pack_qkv_destination_major,
            q,
            q,
            q,
            2,
            out=torch.empty(2, 5, 2, 25, device="cuda"),
        )
        expect(
            ValueError,
            "usp_merge_heads expects x to be 5-D [W, S, B, h_local, D], got torch.Size([5, 4, 8])",
            attnprep.usp_merge_heads,
            q,
        )
        args = rope_args("cuda")
        expect(
            ValueError,
            "q shape must be [num_tokens, num_qo_heads, head_dim], got torch.Size([4, 8, 64])",
            attnprep.rope_pool_fused,
            *args,
            **dict(ROPE_KW, num_qo_heads=4),
        )
        expect(
            ValueError,
            "rope_pool_fused expects an even rotary_dim in [2, head_dim], got -2",
            attnprep.rope_pool_fused,
            *args,
            rotary_dim=-2,
            **ROPE_KW,
        )


LAYOUT_CODE = """
import warnings, torch, attnprep
warnings.simplefilter("ignore")  # the sparse CSR and nested constructors' beta/prototype notices
dense = torch.randn(4, 8, 16)
for bad, shown in [(torch.randn(4, 8, 16).to_sparse(), "torch.sparse_coo"),
                   (torch.randn(4, 16).to_sparse_csr(), "torch.sparse_csr"),
                   (torch.randn(4, 8, 16).to_mkldnn(), "torch._mkldnn"),
                   (torch.nested.nested_tensor([torch.randn(2, 16), torch.randn(3, 16)]), "a nested tensor")]:
    for call, name in [(lambda: attnprep.pack_qkv_destination_major(dense, bad, dense, 2), "k"),
                       (lambda: attnprep.usp_merge_heads(bad), "x")]:
        try:
            call()
        except ValueError as e:
            assert str(e) == f"{name} must be a strided tensor, got {shown}", str(e)
        else:
            raise AssertionError("no error")
"""


def test_tensors_of_other_layouts_get_the_layout_message():
    """Sparse, mkldnn and nested tensors: torch's DLPack refusal reads as an
    internal error ("doesn't have storage"), so the layout is named; through
    torch's exchange API and through the DLPack fallback."""
    subprocess.run([sys.executable, "-c", LAYOUT_CODE], check=True)
    env = dict(os.environ, ATTNPREP_DISABLE_EXCHANGE_API="1")
    subprocess.run([sys.executable, "-c", LAYOUT_CODE], check=True, env=env)


def test_meta_tensors_get_the_device_message():
    m = torch.empty(4, 8, 16, device="meta")
    expect(ValueError, "q, k, and v must be CUDA tensors", attnprep.pack_qkv_destination_major, m, m, m, 2)
    expect(
        ValueError,
        "usp_merge_heads expects a CUDA tensor",
        attnprep.usp_merge_heads,
        torch.empty(2, 3, 1, 4, 8, device="meta"),
    )
    expect(
        ValueError,
        "rope_pool_fused expects CUDA or MPS tensors",
        attnprep.rope_pool_fused,
        *rope_args("meta"),
        **ROPE_KW,
    )


# ---------------------------------------------------------------- argument types on every path


def _pack_call(device, **bad):
    q = torch.randn(4, 8, 16, device=device)
    a = dict(q=q, k=q, v=q, world_size=2)
    a.update(bad)
    return lambda: attnprep.pack_qkv_destination_major(**a)


def _rope_call(device, **bad):
    q, k, v, positions, slots, k_pool, v_pool = rope_args(device)
    a = dict(q=q, k=k, v=v, positions=positions, slots=slots, k_pool=k_pool, v_pool=v_pool, **ROPE_KW)
    a.update(bad)
    return lambda: attnprep.rope_pool_fused(**a)


RP = "rope_pool_fused"
# (call, the wrong arguments, the TypeError every path raises): the first wrong
# argument in the extension's reading order names itself
WRONG_TYPES = [
    (_pack_call, dict(world_size="2"), "pack_qkv_destination_major: world_size must be an int, got str"),
    (_pack_call, dict(world_size=True), "pack_qkv_destination_major: world_size must be an int, got bool"),
    (_pack_call, dict(world_size=2.0), "pack_qkv_destination_major: world_size must be an int, got float"),
    (_pack_call, dict(out=[0]), "out must be a torch.Tensor, got list"),
    (_pack_call, dict(v=None, world_size="2"), "v must be a torch.Tensor, got NoneType"),
    (_rope_call, dict(head_dim="64"), f"{RP}: head_dim must be an int, got str"),
    (_rope_call, dict(num_qo_heads=8.0), f"{RP}: num_qo_heads must be an int, got float"),
    (_rope_call, dict(num_kv_heads=True), f"{RP}: num_kv_heads must be an int, got bool"),
    (_rope_call, dict(rope_base="1e4"), f"{RP}: rope_base must be a number, got str"),
    (_rope_call, dict(rope_base=False), f"{RP}: rope_base must be a number, got bool"),
    (_rope_call, dict(rotary_dim=32.0), f"{RP}: rotary_dim must be an int, got float"),
    (_rope_call, dict(is_neox=1), f"{RP}: is_neox must be a bool, got int"),
    (_rope_call, dict(inplace=None), f"{RP}: inplace must be a bool, got NoneType"),
    (_rope_call, dict(check_slots="no"), f"{RP}: check_slots must be a bool, got str"),
    (_rope_call, dict(check_slots=1, k_scale=1.0), f"{RP}: check_slots must be a bool, got int"),
    (_rope_call, dict(inplace=0, check_slots=1), f"{RP}: inplace must be a bool, got int"),
    (_rope_call, dict(kv_layout=None), f"{RP}: kv_layout must be a str, got NoneType"),
    (_rope_call, dict(norm_eps="1e-6"), f"{RP}: norm_eps must be a number, got str"),
    (_rope_call, dict(norm_weight_offset=None), f"{RP}: norm_weight_offset must be a number, got NoneType"),
    (_rope_call, dict(k_scale=1.0), "k_scale must be a torch.Tensor, got float"),
    (_rope_call, dict(slots=[0, 1, 2, 3]), "slots must be a torch.Tensor, got list"),
    (_rope_call, dict(head_dim="64", cos_sin_cache=[1.0]), f"{RP}: head_dim must be an int, got str"),
    (_rope_call, dict(cos_sin_cache=[1.0], inplace=None), "cos_sin_cache must be a torch.Tensor, got list"),
    (_rope_call, dict(kv_layout=0, norm_eps=None, q_norm_weight="w"), f"{RP}: kv_layout must be a str, got int"),
    (_rope_call, dict(norm_eps=None, q_norm_weight="w"), "q_norm_weight must be a torch.Tensor, got str"),
    # a tensor is no number argument, whatever it holds
    (_rope_call, dict(rope_base=torch.tensor(1e4)), f"{RP}: rope_base must be a number, got Tensor"),
    (_rope_call, dict(norm_eps=torch.tensor(1e-6)), f"{RP}: norm_eps must be a number, got Tensor"),
    (_rope_call, dict(head_dim=torch.tensor(64)), f"{RP}: head_dim must be an int, got Tensor"),
    (_pack_call, dict(world_size=torch.tensor(2)), "pack_qkv_destination_major: world_size must be an int, got Tensor"),
]


@pytest.mark.parametrize("call, bad, msg", WRONG_TYPES, ids=[str(c[1]) for c in WRONG_TYPES])
def test_wrong_types_raise_alike_on_every_path(call, bad, msg):
    """The same TypeError eagerly (the extension reads the arguments), through the dispatcher
    (FakeTensors: attnprep reads them before torch's schema can) and under torch.compile, where
    dynamo reports it as its ObservedTypeError (torch 2.11: without the message; torch 2.4: an
    ObservedException without either); a bool is never taken for an int."""
    expect(TypeError, msg, call("cpu", **bad))
    with FakeTensorMode():
        expect(TypeError, msg, call("cuda", **bad))
    with pytest.raises(Exception) as e:
        compiled(lambda: call("cpu", **bad)())()
    cause = root_cause(e.value)
    assert (
        (type(cause) is TypeError and str(cause) == msg)
        or (
            type(cause).__name__ == "ObservedTypeError"
            and str(cause)
            in (
                f"raised exception {TypeError(msg)!r}",
                # torch 2.11's dynamo names the exception's type without its message
                "raised exception ExceptionVariable(<class 'TypeError'>)",
            )
        )
        or (
            # torch 2.4's dynamo reports that the traced code raised, without the exception
            type(cause).__name__ == "ObservedException" and str(cause) == "raised exception ExceptionVariable()"
        )
    ), repr(cause)


@pytest.mark.parametrize("value", [2**63, 2**70, -(2**63) - 1])
def test_ints_past_int64_fail_their_range_check_in_turn_on_every_path(value):
    """Eagerly and through the dispatcher alike: the range check of that argument, after the
    checks before it (on CPU tensors the device check comes first)."""
    world = "world_size must be positive and divide global_heads"
    shape = "q shape must be [num_tokens, num_qo_heads, head_dim], got torch.Size([4, 8, 64])"
    rotary = "rope_pool_fused expects an even rotary_dim in [2, head_dim], got "
    saturated = 2**63 - 1 if value > 0 else -(2**63)
    expect(ValueError, "q, k, and v must be CUDA tensors", _pack_call("cpu", world_size=value))
    expect(ValueError, shape, _rope_call("cpu", head_dim=value))
    expect(ValueError, "q, k, and v must be CUDA tensors", compiled(lambda: _pack_call("cpu", world_size=value)()))
    with FakeTensorMode():
        expect(ValueError, world, _pack_call("cuda", world_size=value))
        expect(ValueError, shape, _rope_call("cuda", head_dim=value))
        expect(ValueError, shape, _rope_call("cuda", num_qo_heads=value))
        expect(ValueError, rotary + str(saturated), _rope_call("cuda", rotary_dim=value))


def test_numpy_arrays_are_not_tensors():
    """Anything with __dlpack__ but a torch.Tensor gets the documented TypeError, eagerly and
    through the dispatcher alike."""
    import numpy as np

    a = np.zeros((4, 8, 16), dtype=np.float32)
    expect(TypeError, "q must be a torch.Tensor, got ndarray", _pack_call("cpu", q=a))
    expect(TypeError, "x must be a torch.Tensor, got ndarray", attnprep.usp_merge_heads, np.zeros((1,) * 5))
    expect(TypeError, "k must be a torch.Tensor, got ndarray", _rope_call("cpu", k=a))
    with FakeTensorMode():
        expect(TypeError, "q must be a torch.Tensor, got ndarray", _pack_call("cuda", q=a))
        expect(TypeError, "k must be a torch.Tensor, got ndarray", _rope_call("cuda", k=a))


def _numbers():
    import fractions

    import numpy as np

    return [1e4, 10000, np.float64(1e4), np.float32(1e4), np.int64(10000), np.int32(10000), fractions.Fraction(10000)]


@pytest.mark.parametrize("i", range(7))
def test_number_arguments_accept_python_and_numpy_numbers_alike(i):
    """rope_base (a number) and head_dim (an int) take Python's and numpy's scalars on the eager
    and the dispatcher paths: the call goes on to the same check (CPU tensors: the device's;
    FakeTensors: none fails); numpy's bool is refused as bool is."""
    import numpy as np

    base = _numbers()[i]
    expect(ValueError, "rope_pool_fused expects CUDA or MPS tensors", _rope_call("cpu", rope_base=base))
    expect(ValueError, "rope_pool_fused expects CUDA or MPS tensors", _rope_call("cpu", head_dim=np.int64(64)))
    with FakeTensorMode():
        q_rot, _, _, _ = _rope_call("cuda", rope_base=base, head_dim=np.int64(64))()
        assert q_rot.shape == (4, 8, 64)
    expect(
        TypeError,
        f"{RP}: rope_base must be a number, got {type(np.bool_(True)).__name__}",
        _rope_call("cpu", rope_base=np.bool_(True)),
    )
