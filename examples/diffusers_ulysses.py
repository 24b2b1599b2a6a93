"""A diffusers transformer under Ulysses sequence parallelism through attnprep, against the same model in one
process.

diffusers' own context parallelism shards the model's inputs and gathers its output
(``model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=W))``); attnprep runs the attention:
``enable_ulysses()`` routes diffusers' Ulysses attention through ``attnprep.ulysses.ulysses_attention`` (one
exchange each way, any head count, uneven rows), and ``fuse_send_side(model)`` gives the attention of Wan, Flux and
Qwen-Image one pass for the QK norm, RoPE and the pack on the CUDA send side. Tiny random models by default (no
download); every rank prints the largest difference from the one-process output, relative to its largest value.

    torchrun --nproc-per-node 2 examples/diffusers_ulysses.py                  # NCCL, one GPU per rank
    python examples/diffusers_ulysses.py --cpu --world 2 --model flux         # gloo processes on the CPU
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def tiny_model(name: str, heads: int):
    """A small random diffusers transformer (head_dim 128) and its inputs, batch 2."""
    from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel, WanTransformer3DModel

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "wan":
        model = WanTransformer3DModel(
            num_attention_heads=heads, attention_head_dim=128, in_channels=4, out_channels=4, text_dim=32,
            freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64,
        )  # fmt: skip
        inputs = dict(
            hidden_states=torch.randn(2, 4, 4, 8, 8, generator=g),  # 4 frames of 4 x 4 patches: 64 tokens
            encoder_hidden_states=torch.randn(2, 16, 32, generator=g),
            timestep=torch.tensor([500, 500]),
        )
    elif name == "qwen_image":
        model = QwenImageTransformer2DModel(
            patch_size=1, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=128,
            num_attention_heads=heads, joint_attention_dim=32, axes_dims_rope=(16, 56, 56),
        )  # fmt: skip
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, 11:] = 0  # the second prompt: 11 tokens of 16
        inputs = dict(
            hidden_states=torch.randn(2, 64, 16, generator=g),  # one frame of 8 x 8 patches
            encoder_hidden_states=torch.randn(2, 16, 32, generator=g),
            encoder_hidden_states_mask=mask,
            timestep=torch.full((2,), 0.5),
            img_shapes=[(1, 8, 8)] * 2,
        )
    else:
        model = FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=128,
            num_attention_heads=heads, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[16, 56, 56],
        )  # fmt: skip
        image, text = 64, 16
        inputs = dict(
            hidden_states=torch.randn(2, image, 16, generator=g),
            encoder_hidden_states=torch.randn(2, text, 32, generator=g),
            pooled_projections=torch.randn(2, 32, generator=g),
            timestep=torch.full((2,), 0.5),
            img_ids=torch.stack([torch.zeros(image), torch.arange(image) // 8, torch.arange(image) % 8], -1),
            txt_ids=torch.zeros(text, 3),
        )
    return model.eval(), inputs


def _to(value, device, dtype):
    """A tensor input on the device, floating ones in dtype; other inputs as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)


def run(rank: int, world: int, args) -> None:
    from attnprep.integrations import diffusers as integration
    from diffusers.models._modeling_parallel import ContextParallelConfig

    device = torch.device("cpu") if args.cpu else torch.device("cuda", rank)
    if not args.cpu:
        torch.cuda.set_device(device)
    else:  # diffusers' enable_parallelism divides by the accelerator count, zero in a CPU-only process
        torch.accelerator.device_count = lambda: 1
    dist.init_process_group("gloo" if args.cpu else "nccl", rank=rank, world_size=world)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    model, inputs = tiny_model(args.model, args.heads)
    model = model.to(device=device, dtype=dtype)
    inputs = {k: _to(v, device, dtype) for k, v in inputs.items()}
    with torch.no_grad():
        want = model(**inputs, return_dict=False)[0].float()
        integration.enable_ulysses()
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        fused = integration.fuse_send_side(model)
        got = model(**inputs, return_dict=False)[0].float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    fused_note = f"{fused} processors with attnprep's send side"
    print(f"rank {rank}: {args.model} {dtype} on {world} ranks ({fused_note}): relative error {err:.2e}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _spawned(rank: int, world: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    run(rank, world, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["wan", "flux", "qwen_image"], default="wan")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--cpu", action="store_true", help="gloo processes on the CPU (spawned here)")
    parser.add_argument("--world", type=int, default=2, help="with --cpu: how many processes")
    parser.add_argument("--port", type=int, default=29511)
    args = parser.parse_args()
    if args.cpu:
        mp.spawn(_spawned, args=(args.world, args), nprocs=args.world)
    else:
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()
