"""The ops have no backward: in grad mode a tensor argument that requires
grad gets the documented ValueError, on every device and path (eager,
dispatcher, torch.compile); under torch.no_grad() the same call runs as any
other (the device's own result: the output on CUDA, the device message on
the CPU)."""

import attnprep
import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MESSAGE = "{}: the op is inference-only; its tensors must not require grad (use torch.no_grad())"


def calls(device):
    g = torch.Generator().manual_seed(0)

    def t(*shape, grad=False):
        return torch.randn(*shape, generator=g).to(device).requires_grad_(grad)

    q, k, v = t(4, 2, 64), t(4, 2, 64), t(4, 2, 64)
    weight = t(64, grad=True)  # a module's parameter, as a model passes its q_norm weight
    pools = (torch.zeros(8, 2, 64, device=device), torch.zeros(8, 2, 64, device=device))
    idx = torch.arange(4, device=device)
    kw = dict(head_dim=64, num_qo_heads=2, num_kv_heads=2, rope_base=1e4)
    return {
        "usp_merge_heads": lambda: attnprep.usp_merge_heads(t(2, 3, 1, 2, 64, grad=True)),
        "pack_qkv_destination_major": lambda: attnprep.pack_qkv_destination_major(q, t(4, 2, 64, grad=True), v, 2),
        "rope_pool_fused": lambda: attnprep.rope_pool_fused(q, k, v, idx, idx, *pools, q_norm_weight=weight, **kw),
        "mla_rope_pool_fused": lambda: attnprep.mla_rope_pool_fused(
            t(4, 2, 96),
            t(4, 64),
            t(4, 32),
            idx,
            idx,
            torch.zeros(8, 96, device=device),
            kv_norm_weight=t(64, grad=True),
        ),
    }


def outcome(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "op", ["usp_merge_heads", "pack_qkv_destination_major", "rope_pool_fused", "mla_rope_pool_fused"]
)
def test_tensors_that_require_grad_are_refused_in_grad_mode(device, op):
    fn = calls(device)[op]
    assert outcome(fn) == MESSAGE.format(op)
    torch._dynamo.reset()
    assert outcome(torch.compile(fn, backend="eager", fullgraph=False)) == MESSAGE.format(op)
    with torch.no_grad():
        got = outcome(fn)
    if device == "cpu":
        assert got is not None and "CUDA" in got  # the device's own message, not the grad one
    else:
        assert got is None
