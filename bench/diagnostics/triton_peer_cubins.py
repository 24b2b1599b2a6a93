"""The Triton rope_pool_fused peer (bench/peers.py) as this machine's Triton compiles it.

    python bench/diagnostics/triton_peer_cubins.py OUT_DIR

Calls the peer with the QK norm at the norm table's geometries (32/8 and 64/8 heads, head_dim 128,
bf16) at T = 128 and 2048, prints the warp count its autotuner chose for each, then every variant
the autotuner compiled (warps, registers, spills) and writes its cubin and TTGIR into OUT_DIR
(disassemble with `cuobjdump -sass`).
"""

import sys
from pathlib import Path

import torch

import attnprep

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import peers  # noqa: E402

D, MAXPOS, POOL = 128, 131072, 1 << 20


def compiled_kernels(jit_fn):
    """Every compiled variant in a JITFunction's cache (the cache's layout differs between Triton releases)."""
    caches = getattr(jit_fn, "device_caches", None)
    if caches:
        return [k for entry in caches.values() for k in (entry[0] if isinstance(entry, tuple) else entry).values()]
    return [k for per_device in jit_fn.cache.values() for k in per_device.values()]


def main(out: Path):
    if peers.triton is None:
        sys.exit("Triton is not installed")
    out.mkdir(parents=True, exist_ok=True)
    print("triton", peers.triton.__version__, "torch", torch.__version__)
    cache = attnprep.rope_cos_sin_cache(D, MAXPOS, 10000.0, device="cuda")  # the table the benchmark passes
    for hq, hkv in [(32, 8), (64, 8)]:
        k_pool = torch.zeros(POOL, hkv, D, device="cuda", dtype=torch.bfloat16)
        v_pool = torch.zeros_like(k_pool)
        w = torch.ones(D, device="cuda", dtype=torch.bfloat16)
        for T in [128, 2048]:
            q = torch.randn(T, hq, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(T, hkv, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(T, hkv, D, device="cuda", dtype=torch.bfloat16)
            positions = torch.randint(0, MAXPOS, (T,), device="cuda")
            slots = torch.randperm(POOL, device="cuda")[:T]
            peers.triton_rope_pool(q, k, v, positions, slots, k_pool, v_pool, cache, w, w)
            torch.cuda.synchronize()
            print(f"{hq}/{hkv} T={T}: autotuner chose {peers.triton_rope_pool_warps()} warps")
    for n, kernel in enumerate(compiled_kernels(peers._rope_pool_kernel.fn)):
        name = f"rope_pool_{n}_w{kernel.metadata.num_warps}"
        print(f"{name}: {kernel.n_regs} registers, {kernel.n_spills} spills")
        (out / f"{name}.cubin").write_bytes(kernel.asm["cubin"])
        (out / f"{name}.ttgir").write_text(kernel.asm["ttgir"])


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "triton_peer_cubins"))
