"""pack_qkv_destination_major against the plain-torch reference of attnprep.testing (docs/contract.md)."""

import os
import subprocess
import sys
import warnings

import attnprep
import pytest
import torch
from attnprep import pack_qkv_destination_major as pack
from attnprep.testing import pack_reference
from conftest import poison_like, requires_cuda, requires_two_gpus, same_bits

reference = pack_reference


def random_tensor(shape, dtype, device):
    x = torch.randn(shape, device=device, dtype=torch.float32)
    return x.to(dtype)


def make_inputs(rows, heads, dim, dtype, layout, device="cuda"):
    """q, k, v as separate contiguous tensors or as slices of one fused projection."""
    if layout == "fused":
        qkv = random_tensor((rows, 3 * heads * dim), dtype, device)
        return tuple(t.view(rows, heads, dim) for t in qkv.split(heads * dim, dim=1))
    if layout == "strided":  # every other row of a larger buffer, different strides per tensor
        return tuple(random_tensor((2 * rows, heads, dim), dtype, device)[::2] for _ in range(3))
    return tuple(random_tensor((rows, heads, dim), dtype, device) for _ in range(3))


# ---------------------------------------------------------------- messages

MSG_SHAPE = "q, k, and v must have the same 3D shape"
MSG_CUDA = "q, k, and v must be CUDA tensors"
MSG_SAME = "q, k, and v must have the same device and dtype"
MSG_UNIT = "q, k, and v must be contiguous in head_size"
MSG_WORLD = "world_size must be positive and divide global_heads"
MSG_OUT = "out must be a contiguous tensor with the expected shape, device, and dtype"
MSG_OVERLAP = "out must not overlap q, k, or v"
MSG_TOO_LARGE = "q, k, and v are too large: the output would exceed 2^63 - 1 bytes"


def raises(msg, *args, **kwargs):
    with pytest.raises(ValueError) as e:
        pack(*args, **kwargs)
    assert str(e.value) == msg


def test_messages_reachable_on_cpu():
    q = torch.randn(4, 8, 16)
    raises(MSG_SHAPE, q[0], q[0], q[0], 2)
    raises(MSG_SHAPE, q, q[:, :4], q, 2)
    raises(MSG_SHAPE, q, q, q[:3], 2)
    raises(MSG_SHAPE, q.unsqueeze(0), q.unsqueeze(0), q.unsqueeze(0), 2)
    raises(MSG_CUDA, q, q, q, 2)
    raises(MSG_CUDA, q, q, q, 0)  # device is checked before world_size


def test_outputs_past_int64_bytes_are_refused():
    """Check 8, on fake CUDA tensors (no GPU needed): empty and expanded inputs whose output torch
    could not describe; with `out` given, check 6 refuses every out instead."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        empty = torch.empty(0, 1, 1 << 62, device="cuda", dtype=torch.bfloat16)  # 3 * head_size past int64
        expanded = torch.empty(1, 4, 8, device="cuda").expand(1 << 56, 4, 8)  # 2^56 * 4 * 24 * 4 bytes
        for q in (empty, expanded):
            raises(MSG_TOO_LARGE, q, q, q, 1)
            raises(MSG_OUT, q, q, q, 1, out=torch.empty(1, 1, 1, 24, device="cuda", dtype=q.dtype))
        fits = torch.empty(0, 1, 1 << 40, device="cuda", dtype=torch.bfloat16)  # 3 * 2^40 * 2 bytes: allowed
        assert pack(fits, fits, fits, 1).shape == (1, 0, 1, 3 << 40)


TORCH_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def dlpack_error(dtype):
    """torch's own error where it cannot hand a tensor of `dtype` over through DLPack (the quantized
    and bits dtypes), else None."""
    with warnings.catch_warnings():  # torch's notices on complex32 and the quantized dtypes
        warnings.simplefilter("ignore")
        try:
            torch.empty(2, 3, dtype=dtype).__dlpack__()
            return None
        except (RuntimeError, BufferError) as e:
            return e


def exportable(dtype):
    return dlpack_error(dtype) is None


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_every_torch_dtype_is_read_as_torch_names_it(dtype):
    """Both imports see each dtype as torch prints it, so messages name it and two dtypes never pass
    for one (DLPack alone calls torch.int4 an 8-bit integer); torch's own error where it cannot export."""
    x = torch.empty(2, 3, dtype=dtype)
    assert attnprep._C._imported_dtype(torch.empty(2, 3, dtype=dtype, device="meta"), True) == str(dtype)
    error = dlpack_error(dtype)
    if error is None:
        assert attnprep._C._imported_dtype(x, False) == str(dtype)
    else:  # torch's message (its first line: torch's C++ errors may carry a backtrace below it)
        with pytest.raises((RuntimeError, BufferError)) as e:
            attnprep._C._imported_dtype(x, False)
        assert str(e.value).splitlines()[0] == str(error).splitlines()[0]


def test_every_torch_dtype_through_the_fallback_import_path():
    code = (
        "import torch, attnprep\n"
        "assert attnprep.build_info()['dlpack_path'] == 'dlpack-fallback'\n"
        "for name in %r:\n"
        "    got = attnprep._C._imported_dtype(torch.empty(2, 3, dtype=getattr(torch, name[6:])), False)\n"
        "    assert got == name, (got, name)\n"
    ) % ([str(d) for d in TORCH_DTYPES if exportable(d)],)
    env = dict(os.environ, ATTNPREP_DISABLE_EXCHANGE_API="1")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_dtype_messages_name_every_dtype():
    """On fake CUDA tensors (no GPU needed): the messages that print a dtype, with dtypes that used
    to print as 'unknown dtype', and two dtypes DLPack describes alike."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    names = ("uint16", "int4", "float8_e8m0fnu", "complex32", "float4_e2m1fn_x2")
    dtypes = [getattr(torch, n) for n in names if hasattr(torch, n)]  # those of this torch release
    assert len(dtypes) >= 2
    with FakeTensorMode():
        for dtype in dtypes:
            with pytest.raises(ValueError) as e:
                attnprep.usp_merge_heads(torch.empty(2, 3, 1, 4, 8, device="cuda", dtype=dtype))
            assert str(e.value) == f"Unsupported usp_merge_heads dtype: {dtype}"
        if hasattr(torch, "int4"):
            q = torch.empty(4, 2, 8, device="cuda", dtype=torch.int8)
            raises(MSG_SAME, q, q.to(torch.int4), q, 1)


class NewerTensor:
    """A tensor's metadata as a newer torch describes one of a dtype this build has never seen
    (torch 2.14's bcomplex32 under a build against 2.13): what the fake kernels read."""

    def __init__(self, shape, dtype_name, itemsize):
        self.shape, self.layout, self._itemsize = torch.Size(shape), torch.strided, itemsize
        self.dtype = type("dtype", (), {"__str__": lambda _: dtype_name})()
        self.device = torch.device("cuda", 0)

    def stride(self):
        return torch.empty(self.shape, device="meta").stride()

    def element_size(self):
        return self._itemsize


def test_dtypes_newer_than_the_build_are_named_by_torch_and_kept_apart():
    x = NewerTensor((2, 3, 1, 4, 8), "torch.bcomplex32", 4)
    assert attnprep._C._imported_dtype(x, True) == "torch.bcomplex32"
    with pytest.raises(ValueError) as e:
        attnprep._C._usp_merge_heads_meta(x)
    assert str(e.value) == "Unsupported usp_merge_heads dtype: torch.bcomplex32"
    a, b = NewerTensor((4, 2, 8), "torch.bcomplex32", 4), NewerTensor((4, 2, 8), "torch.float32x", 4)
    with pytest.raises(ValueError) as e:  # two newer dtypes of one size are still two dtypes
        attnprep._C._pack_qkv_meta(a, b, a, 1, None)
    assert str(e.value) == MSG_SAME
    assert attnprep._C._pack_qkv_meta(a, a, a, 1, None) == [1, 4, 2, 24]


def test_messages_through_the_fallback_import_path():
    """The same checks when torch's DLPack exchange table is not used."""
    code = (
        "import torch, attnprep\n"
        "assert attnprep.build_info()['dlpack_path'] == 'dlpack-fallback'\n"
        "q = torch.randn(4, 8, 16)\n"
        "for args, msg in [((q[0], q[0], q[0], 2), %r), ((q, q, q, 2), %r)]:\n"
        "    try:\n"
        "        attnprep.pack_qkv_destination_major(*args)\n"
        "    except ValueError as e:\n"
        "        assert str(e) == msg, str(e)\n"
        "    else:\n"
        "        raise SystemExit('no error')\n"
    ) % (MSG_SHAPE, MSG_CUDA)
    env = dict(os.environ, ATTNPREP_DISABLE_EXCHANGE_API="1")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_non_tensor_argument_is_a_type_error():
    q = torch.randn(4, 8, 16)
    for i, name in enumerate(("q", "k", "v")):
        for bad in ([1, 2], None, 3.0):
            args = [q, q, q]
            args[i] = bad
            with pytest.raises(TypeError) as e:
                pack(*args, 2)
            assert str(e.value) == f"{name} must be a torch.Tensor, got {type(bad).__name__}"


@pytest.mark.parametrize("world_size, kind", [(None, "NoneType"), ("2", "str"), (2.0, "float"), (True, "bool")])
def test_world_size_of_the_wrong_type(world_size, kind):
    q = torch.randn(4, 8, 16)
    with pytest.raises(TypeError) as e:
        pack(q, q, q, world_size)
    assert str(e.value) == f"pack_qkv_destination_major: world_size must be an int, got {kind}"


def test_world_size_past_int64_and_many_dimensions():
    """A world_size past int64 fails check 5 in its turn: after the device check, and also where
    it would divide global_heads (0 heads) or equal it (an expanded q of 2^63 - 1 heads)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q = torch.randn(4, 8, 16)
    for world_size in (2**63, -(2**63) - 1, 2**70, -(2**70)):
        raises(MSG_CUDA, q, q, q, world_size)
        raises(MSG_SHAPE, q, q[:, :4], q, world_size)
    with FakeTensorMode():
        no_heads = torch.empty(4, 0, 16, device="cuda")
        most_heads = torch.empty(1, 1, 1, device="cuda").expand(1, 2**63 - 1, 1)
        for x in (torch.empty(4, 8, 16, device="cuda"), no_heads, most_heads):
            for world_size in (2**63, 2**64 - 1, 2**70, -(2**63) - 1, -(2**70)):
                raises(MSG_WORLD, x, x, x, world_size)
                raises(MSG_WORLD, x, x, x, world_size, out=torch.empty(1, device="cuda"))
        # the largest int64 divides 0 heads: check 5 passes, and check 8 refuses the output
        raises(MSG_TOO_LARGE, no_heads, no_heads, no_heads, 2**63 - 1)
    nine = torch.empty([1] * 9)
    raises(MSG_SHAPE, nine, nine, nine, 2)
    raises(MSG_SHAPE, q, q, torch.empty([1] * 12), 2)


@requires_cuda
def test_messages_on_cuda():
    q, k, v = make_inputs(4, 8, 16, torch.bfloat16, "contiguous")
    raises(MSG_SHAPE, q, k[:, :4], v, 2)
    raises(MSG_CUDA, q, k.cpu(), v, 2)
    raises(MSG_SAME, q, k.half(), v, 2)
    raises(MSG_SAME, q, k, v.float(), 0)  # dtype before world_size
    strided = torch.randn(4, 8, 32, device="cuda", dtype=torch.bfloat16)[:, :, ::2]
    raises(MSG_UNIT, q, k, strided, 2)
    raises(MSG_UNIT, strided, k, v, 3)  # unit stride before world_size
    for w in (0, -1, 3, 16):
        raises(MSG_WORLD, q, k, v, w)
    good = torch.empty(2, 4, 4, 48, device="cuda", dtype=torch.bfloat16)
    assert pack(q, k, v, 2, out=good) is good
    with pytest.raises(TypeError) as e:
        pack(q, k, v, 2, out=[1])
    assert str(e.value) == "out must be a torch.Tensor, got list"
    raises(MSG_OUT, q, k, v, 2, out=torch.empty(2, 4, 4, 47, device="cuda", dtype=torch.bfloat16))
    raises(MSG_OUT, q, k, v, 2, out=good.half())
    raises(MSG_OUT, q, k, v, 2, out=good.cpu())
    raises(MSG_OUT, q, k, v, 2, out=torch.empty(2, 4, 4, 96, device="cuda", dtype=torch.bfloat16)[..., ::2])
    raises(MSG_OUT, q, k, v, 2, out=good.view(4, 2, 4, 48).transpose(0, 1))
    raises(MSG_OUT, q, k, v, 1, out=good)
    # out sharing memory with an input: refused before anything is written
    buf = torch.randn(2 * 4 * 3 * 8 * 16, device="cuda", dtype=torch.bfloat16)
    qkv = buf[: 4 * 3 * 8 * 16].view(4, 3 * 8 * 16)
    a, b, c = (t.view(4, 8, 16) for t in qkv.split(8 * 16, dim=1))
    before = buf.clone()
    raises(MSG_OVERLAP, a, b, c, 2, out=qkv.view(2, 4, 4, 48))
    raises(MSG_OVERLAP, a, b, c, 2, out=buf[100 : 100 + 2 * 4 * 4 * 48].view(2, 4, 4, 48))
    torch.cuda.synchronize()
    assert same_bits(buf, before)
    assert pack(a, b, c, 2, out=buf[4 * 3 * 8 * 16 :].view(2, 4, 4, 48)) is not None  # adjacent, not overlapping


# ---------------------------------------------------------------- correctness

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


@requires_cuda
@pytest.mark.parametrize("layout", ["contiguous", "fused", "strided"])
@pytest.mark.parametrize("rows", [1, 17, 65, 4096])
@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(dtype, world_size, head_size, rows, layout):
    q, k, v = make_inputs(rows, 24, head_size, dtype, layout)
    want = reference(q, k, v, world_size)
    got = pack(q, k, v, world_size)
    assert got.is_contiguous() and got.device == q.device
    assert same_bits(got, want)
    out = poison_like(want.shape, dtype, "cuda")
    assert pack(q, k, v, world_size, out=out) is out
    assert same_bits(out, want)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.int32, torch.int64, torch.bool], ids=str)
def test_any_element_size_is_copied(dtype):
    x = torch.randint(0, 100, (17, 12, 10), device="cuda").to(dtype)
    q, k, v = x, x.flip(0), x.roll(3, 1)
    assert same_bits(pack(q, k, v, 4), reference(q, k, v, 4))


@requires_cuda
@pytest.mark.parametrize("dtype", [d for d in TORCH_DTYPES if exportable(d)], ids=str)
def test_every_exportable_dtype_is_copied_and_kept(dtype):
    """torch.int4 and torch.float4_e2m1fn_x2 included: the output has q's dtype (not DLPack's 8-bit
    integer) and its bytes are the pack of q's, k's and v's bytes."""
    es = torch.empty(0, dtype=dtype).element_size()
    raw = [torch.randint(0, 256, (17, 12, 10 * es), device="cuda", dtype=torch.uint8) for _ in range(3)]
    out = pack(*(t.view(dtype) for t in raw), 4)
    assert out.dtype == dtype and out.shape == (4, 17, 3, 30)
    assert torch.equal(out.view(torch.uint8), reference(*raw, 4))


@requires_cuda
@pytest.mark.parametrize("offset", [1, 3, 5])
def test_misaligned_views(offset):
    base = torch.randn(65 * 3 * 8 * 40 + offset, device="cuda", dtype=torch.bfloat16)
    qkv = base[offset:].view(65, 3 * 8 * 40)
    q, k, v = (t.view(65, 8, 40) for t in qkv.split(8 * 40, dim=1))
    assert same_bits(pack(q, k, v, 2), reference(q, k, v, 2))
    out_base = poison_like((2 * 65 * 4 * 120 + offset,), torch.bfloat16, "cuda")
    out = out_base[offset:].view(2, 65, 4, 120)
    pack(q, k, v, 2, out=out)
    assert same_bits(out, reference(q, k, v, 2))


@requires_cuda
def test_negative_view_is_copied_as_its_values_or_refused():
    q, k, v = make_inputs(5, 8, 64, torch.float32, "contiguous")
    got = pack(q._neg_view(), k, v, 2)  # a lazily negated view: its values, not its memory
    assert same_bits(got, reference(-q, k, v, 2))
    out = torch.empty(2, 5, 4, 192, device="cuda")
    pack(q, k, v._neg_view(), 2, out=out)
    assert same_bits(out, reference(q, k, -v, 2))


@requires_cuda
def test_zero_strides_and_broadcast_views():
    q = torch.randn(1, 8, 64, device="cuda").expand(33, 8, 64)
    k = torch.randn(33, 1, 64, device="cuda").expand(33, 8, 64)
    v = torch.randn(33, 8, 64, device="cuda")
    assert same_bits(pack(q, k, v, 4), reference(q, k, v, 4))


@requires_cuda
@pytest.mark.parametrize("shape", [(0, 8, 64), (4, 0, 64), (4, 8, 0)])
def test_empty_inputs(shape):
    q = torch.empty(shape, device="cuda", dtype=torch.float16)
    got = pack(q, q, q, 2 if shape[1] else 1)
    assert got.shape == reference(q, q, q, 2 if shape[1] else 1).shape


@requires_cuda
def test_does_not_write_outside_out():
    q, k, v = make_inputs(17, 8, 80, torch.float16, "fused")
    guard = poison_like((2 * 17 * 4 * 240 + 512,), torch.float16, "cuda")
    before = guard.clone()
    out = guard[256 : 256 + 2 * 17 * 4 * 240].view(2, 17, 4, 240)
    pack(q, k, v, 2, out=out)
    assert same_bits(out, reference(q, k, v, 2))
    assert same_bits(guard[:256], before[:256]) and same_bits(guard[-256:], before[-256:])


@requires_cuda
def test_large_offsets_past_2_31_elements():
    rows, heads, dim = (1 << 22) + 1, 8, 64  # 2^31 + 512 elements per input, fp8: 2 GiB each
    try:
        x = torch.empty((rows, heads, dim), device="cuda", dtype=torch.uint8)
        out = torch.empty((2, rows, heads // 2, 3 * dim), device="cuda", dtype=torch.uint8)
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory")
    x[-2:].random_(0, 255)
    x[:2].random_(0, 255)
    pack(x, x, x, 2, out=out)
    want = reference(x[-2:], x[-2:], x[-2:], 2)
    assert same_bits(out[:, -2:], want)
    assert same_bits(out[:, :2], reference(x[:2], x[:2], x[:2], 2))
    del x, out
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- integration


@requires_cuda
def test_runs_on_the_current_stream():
    q, k, v = make_inputs(4096, 24, 128, torch.bfloat16, "fused")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = pack(q, k, v, 4)
        want = reference(q, k, v, 4)
        ok = same_bits(got, want)
    torch.cuda.synchronize()
    assert ok


@requires_cuda
def test_cuda_graph_capture_and_replay():
    q, k, v = make_inputs(65, 24, 128, torch.bfloat16, "fused")
    out = torch.empty(8, 65, 3, 384, device="cuda", dtype=torch.bfloat16)
    pack(q, k, v, 8, out=out)  # warm-up outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        allocated = pack(q, k, v, 8)
        pack(q, k, v, 8, out=out)
    for _ in range(3):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        g.replay()
        torch.cuda.synchronize()
        want = reference(q, k, v, 8)
        assert same_bits(out, want) and same_bits(allocated, want)


@requires_cuda
@pytest.mark.parametrize("rows", [65, 4099])
def test_dependent_calls_back_to_back(rows):
    """Each call reads the previous call's output with no other kernel in
    between. Where kernels launch with programmatic dependent launch (compute
    capability 9.0 and up) the next one starts before the previous ends and
    must wait for its writes: eagerly and as one CUDA graph, the chain must be
    bit-equal to the same calls with a synchronize after each."""
    q, k, v = make_inputs(rows, 8, 128, torch.bfloat16, "contiguous")

    def chain(sync):
        a, b, c = q, k, v
        outs = []
        for _ in range(6):
            o = pack(a, b, c, 1)
            if sync:
                torch.cuda.synchronize()
            parts = o.view(rows, 8, 3, 128).unbind(2)  # strided views of this output
            a, b, c = parts[1], parts[2], parts[0]
            outs.append(o)
        return outs

    want = [o.clone() for o in chain(sync=True)]
    assert not same_bits(want[0], want[1])  # the chain moves data
    got = chain(sync=False)
    torch.cuda.synchronize()
    assert all(same_bits(g, w) for g, w in zip(got, want))
    chain(sync=False)  # warm-up outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = chain(sync=False)
    for o in captured:
        o.copy_(poison_like(o.shape, o.dtype, o.device))
    g.replay()
    torch.cuda.synchronize()
    assert all(same_bits(c, w) for c, w in zip(captured, want))


@requires_cuda
def test_torch_compile_fullgraph():
    def f(qkv, heads, out):
        q, k, v = (t.view(t.shape[0], heads, -1) for t in qkv.split(qkv.shape[1] // 3, dim=1))
        packed = pack(q * 2, k, v, 4)
        pack(q, k, v, 4, out=out)
        return packed + 1

    compiled = torch.compile(f, fullgraph=True)
    qkv = torch.randn(65, 3 * 24 * 64, device="cuda")
    out = torch.empty(4, 65, 6, 192, device="cuda")
    got = compiled(qkv, 24, out)
    q, k, v = (t.view(65, 24, 64) for t in qkv.split(24 * 64, dim=1))
    assert torch.equal(got, reference(q * 2, k, v, 4) + 1)
    assert torch.equal(out, reference(q, k, v, 4))


@requires_cuda
def test_registered_op_and_fake():
    q, k, v = make_inputs(17, 8, 64, torch.float16, "fused")
    got = torch.ops.attnprep.pack_qkv_destination_major(q, k, v, 2)
    assert same_bits(got, reference(q, k, v, 2))
    torch.library.opcheck(torch.ops.attnprep.pack_qkv_destination_major.default, (q, k, v, 2))


@requires_cuda
def test_current_device_is_left_alone():
    before = torch.cuda.current_device()
    q, k, v = make_inputs(4, 8, 64, torch.float16, "contiguous")
    pack(q, k, v, 2)
    assert torch.cuda.current_device() == before


@requires_two_gpus
def test_on_a_device_other_than_the_current_one():
    torch.cuda.set_device(0)
    q, k, v = make_inputs(65, 8, 64, torch.bfloat16, "fused", device="cuda:1")
    got = pack(q, k, v, 2)
    assert got.device == q.device and torch.cuda.current_device() == 0
    assert same_bits(got, reference(q, k, v, 2))
    raises(MSG_SAME, q, k.to("cuda:0"), v, 2)


@requires_cuda
def test_fallback_import_path_on_gpu():
    code = (
        "import torch, attnprep\n"
        "assert attnprep.build_info()['dlpack_path'] == 'dlpack-fallback'\n"
        "q = torch.randn(65, 8, 64, device='cuda', dtype=torch.bfloat16)\n"
        "s = torch.cuda.Stream()\n"
        "with torch.cuda.stream(s):\n"
        "    got = attnprep.pack_qkv_destination_major(q, q * 2, q * 3, 2)\n"
        "torch.cuda.synchronize()\n"
        "want = torch.cat([t.view(65, 2, 4, 1, 64) for t in (q, q*2, q*3)], 3)\n"
        "want = want.permute(1, 0, 2, 3, 4).reshape(2, 65, 4, 192)\n"
        "assert torch.equal(got, want)\n"
    )
    env = dict(os.environ, ATTNPREP_DISABLE_EXCHANGE_API="1")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_build_info():
    info = attnprep.build_info()
    assert info["version"] == attnprep.__version__
    assert info["dlpack_path"] in ("exchange-api", "dlpack-fallback")
    if hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        assert info["dlpack_path"] == "exchange-api"
