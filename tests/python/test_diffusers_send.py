"""attnprep.integrations.diffusers.fuse_send_side: diffusers' own Wan 2.1, Flux and Qwen-Image transformers (tiny,
random, head_dim 128, batch 2; Qwen-Image with a text-padding mask) whose attention sends q, k and v through the
layer's prologue (Flux's double-stream blocks and Qwen-Image with their text norms) must equal the same
model with its own processors; a control whose rotation is the identity must not. On the GPU: one NCCL rank (the
layer's whole path, the exchange of one). On the CPU: the processors leave every call to the model's own code."""

import pytest
import torch
from conftest import nccl_ranks_ok

pytest.importorskip("diffusers")


def _builder(family):
    """The example's tiny model (examples/diffusers_ulysses.py: head_dim 128, batch 2), 2 heads."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "examples" / "diffusers_ulysses.py"
    spec = importlib.util.spec_from_file_location("diffusers_ulysses_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    def make(dtype, device):
        model, inputs = example.tiny_model(family, heads=2)
        return model.to(device=device, dtype=dtype), dict(inputs, return_dict=False)

    return make


# the builder, and how many calls take attnprep's send side
MODELS = {"wan": (_builder("wan"), 2), "flux": (_builder("flux"), 3), "qwen_image": (_builder("qwen_image"), 2)}
REPLACED = {"wan": 4, "flux": 3, "qwen_image": 2}  # Wan's cross-attention modules too
# float32: the QK norm's own summation order against torch's RMSNorm; bfloat16: about two bfloat16 ulp
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _run(model, inputs, dtype, device):
    def to_device(v):
        if not isinstance(v, torch.Tensor):
            return v
        return v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device)

    cast = {k: to_device(v) for k, v in inputs.items()}
    with torch.no_grad():
        return model(**cast)[0].float()


def _identity(rows):
    half = rows.shape[1] // 2
    return torch.cat([torch.ones_like(rows[:, :half]), torch.zeros_like(rows[:, half:])], dim=1)


def _model_body(rank, world, device, cases):
    import torch.distributed as dist
    from attnprep.integrations import diffusers as integration
    from attnprep.integrations import diffusers_send

    layer, given = diffusers_send.ulysses_attention, []
    diffusers_send.ulysses_attention = lambda *a, **kw: given.append(kw.get("prologue") is not None) or layer(*a, **kw)
    failures = []
    for family, dtype, control in cases:
        make, calls = MODELS[family]
        model, inputs = make(dtype, device)
        want = _run(model, inputs, dtype, device)
        count = integration.fuse_send_side(model, group=dist.group.WORLD)
        rows = diffusers_send._rows
        if control:  # cos 1, sin 0: no rotation
            diffusers_send._rows = lambda cos, sin: _identity(rows(cos, sin))
        given.clear()
        try:
            got = _run(model, inputs, dtype, device)
        finally:
            diffusers_send._rows = rows
        err = ((got - want).abs().max() / want.abs().max()).item()
        case = f"{family} {dtype} control={control}"
        if given != [True] * calls:
            failures.append(f"{case}: the layer's calls with a prologue {given}, expected {calls}")
        if count != REPLACED[family]:
            failures.append(f"{case}: {count} processors replaced")
        agree = err <= TOLERANCE[dtype]
        if agree == control:
            failures.append(f"{case}: relative error {err}")
    return "; ".join(failures) or "ok"


def test_models_with_attnpreps_send_side_nccl():
    # the identity control in float32 only: bfloat16's tolerance is wider than what the tiny models' output
    # changes without a rotation (measured 6e-3 to 1.1e-2 relative)
    cases = [(f, d, False) for f in MODELS for d in (torch.float32, torch.bfloat16)]
    cases += [(f, torch.float32, True) for f in MODELS]
    nccl_ranks_ok(1, _model_body, cases)


@pytest.mark.parametrize("family", list(MODELS))
def test_on_the_cpu_the_model_runs_its_own_code(family):
    from attnprep.integrations import diffusers as integration

    model, inputs = MODELS[family][0](torch.float32, "cpu")
    want = _run(model, inputs, torch.float32, "cpu")
    assert integration.fuse_send_side(model) == REPLACED[family]
    assert torch.equal(_run(model, inputs, torch.float32, "cpu"), want)


def test_the_example_runs_on_cpu_processes():
    """examples/diffusers_ulysses.py --cpu: two gloo processes, each within float32 noise of one process."""
    import pathlib
    import re
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:  # a free port for the processes' rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    script = pathlib.Path(__file__).parents[2] / "examples" / "diffusers_ulysses.py"
    done = subprocess.run(
        [sys.executable, str(script), "--cpu", "--world", "2", "--model", "flux", "--heads", "3", "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    errors = [float(x) for x in re.findall(r"relative error ([0-9.e+-]+)", done.stdout)]
    assert len(errors) == 2 and max(errors) < 1e-5, done.stdout
