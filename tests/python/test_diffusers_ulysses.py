"""attnprep.integrations.diffusers inside diffusers' own context parallelism:
a tiny random Flux transformer (diffusers' model class, its own sharding and
gathering hooks) on 2 gloo processes, its Ulysses attention through
attnprep's layer, against the same model in one process. Also a head count
the world size does not divide (3 heads on 2 ranks), which diffusers' own
Ulysses cannot run.

diffusers 0.42's enable_parallelism divides by torch.accelerator.device_count()
(zero in a CPU-only process); the ranks report one device so that its mesh is
built on the CPU."""

import pytest
import torch
from conftest import assert_ranks_ok, run_rank

pytest.importorskip("diffusers")


def flux(heads, seed=0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=heads,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 6, 6],
    ).eval()


def flux_inputs(batch=2, image=12, text=6):
    g = torch.Generator().manual_seed(1)
    img_ids = torch.stack([torch.zeros(image), torch.arange(image) // 4, torch.arange(image) % 4], -1)
    return dict(
        hidden_states=torch.randn(batch, image, 16, generator=g),
        encoder_hidden_states=torch.randn(batch, text, 32, generator=g),
        pooled_projections=torch.randn(batch, 32, generator=g),
        timestep=torch.full((batch,), 0.5),
        img_ids=img_ids,
        txt_ids=torch.zeros(text, 3),
        return_dict=False,
    )


def _flux_body(rank, world, device, heads):
    from attnprep.integrations import diffusers as integration
    from diffusers.models._modeling_parallel import ContextParallelConfig

    torch.accelerator.device_count = lambda: 1  # see the module docstring
    model = flux(heads)
    with torch.no_grad():
        want = model(**flux_inputs())[0]
    calls = []
    layer = integration.ulysses_attention
    integration.ulysses_attention = lambda *a, **k: calls.append(1) or layer(*a, **k)
    integration.enable_ulysses()
    try:
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        with torch.no_grad():
            got = model(**flux_inputs())[0]
    finally:
        integration.disable_ulysses()
    err = ((got - want).abs().max() / want.abs().max()).item()
    if not calls:
        return "attnprep's layer was not called"
    return "ok" if got.shape == want.shape and err <= 1e-6 else f"relative error {err}, shape {tuple(got.shape)}"


@pytest.mark.parametrize("heads", [4, 3])
def test_flux_with_diffusers_context_parallel_hooks(heads):
    assert_ranks_ok(run_rank, 2, "gloo", _flux_body, heads, timeout=240)


def test_an_untested_release_is_refused(monkeypatch):
    from attnprep.integrations import diffusers as integration

    monkeypatch.setattr(integration, "_version", lambda: (0, 41))
    with pytest.raises(RuntimeError) as e:
        integration.enable_ulysses()
    assert str(e.value) == (
        "attnprep.integrations.diffusers: tested with diffusers 0.42, found 0.41 "
        "(enable_ulysses(allow_untested=True) to try it)"
    )
