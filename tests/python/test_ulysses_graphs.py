"""The Ulysses layer captured in a CUDA graph (NCCL collectives are
capturable) and replayed with fresh inputs, against eager calls on the same
inputs: unchunked and chunked, bf16 and fp8 on the wire, NCCL and the
copy-engine transport (its buffers set up by the warm-up call), MHA and GQA (kv
heads split and replicated). One process per GPU; skipped without two."""

import pytest
import torch
from attnprep import ulysses
from conftest import nccl_ranks_ok

# (heads, kv heads) per world size: MHA, GQA split across ranks, GQA replicated
GEOMETRIES = {2: [(8, 8), (8, 4), (8, 1)]}
VARIANTS = [
    dict(chunks=1),
    dict(chunks=2),
    dict(chunks=1, wire_dtype=torch.float8_e4m3fn),
    dict(chunks=1, transport="copy_engine"),
    dict(chunks=2, transport="copy_engine"),
]


def _graphs(rank, world, device):
    rows, dim = 48, 64
    for heads, kv in GEOMETRIES[world]:
        for variant in VARIANTS:

            def fresh(seed):
                g = torch.Generator().manual_seed(seed * 100 + rank)
                return [torch.randn(rows, n, dim, generator=g).to(torch.bfloat16).to(device) for n in (heads, kv, kv)]

            # validate=False: the ranks' agreement reads a collective's result
            # on the host, which a capture cannot; they agree by construction here
            def layer(q, k, v):
                return ulysses.ulysses_attention(q, k, v, causal=True, validate=False, **variant)

            static = fresh(0)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the capture (communicator, kernels)
                layer(*static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = layer(*static)
            for seed in (1, 2):
                for dst, src in zip(static, fresh(seed)):
                    dst.copy_(src)
                graph.replay()
                want = layer(*static)
                torch.cuda.synchronize()
                if not torch.equal(out, want):
                    err = (out.float() - want.float()).abs().max().item()
                    return f"({heads}, {kv}, {variant}): replay differs from eager by {err}"
    return "ok"


@pytest.mark.parametrize("world", [2])
def test_nccl_layer_replayed_as_a_cuda_graph(world):
    nccl_ranks_ok(world, _graphs)
