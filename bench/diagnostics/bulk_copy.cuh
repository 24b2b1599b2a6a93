// Bulk copies (TMA, cp.async.bulk) between global and shared memory, on an
// mbarrier with a transaction count, for the diagnostics that try them
// (small_copy_tma.cu, rope_token_tma.cu). sm_90 and later: callers compile
// their use under __CUDA_ARCH__ >= 900.
#pragma once

#include <cstdint>

namespace diag {

__device__ __forceinline__ uint32_t smem(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// One arrival expected; visible to the bulk-copy (async) proxy after this.
__device__ __forceinline__ void mbarrier_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n fence.proxy.async.shared::cta;" ::: "memory");
}

// The arrival, announcing `bytes` to come from bulk loads on `bar`.
__device__ __forceinline__ void mbarrier_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// Until the barrier's first phase completes (every byte announced has landed).
__device__ __forceinline__ void mbarrier_wait(uint32_t bar) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n .reg .pred q;\n mbarrier.try_wait.parity.shared::cta.b64 q, [%1], 0;\n selp.u32 %0, 1, 0, q;\n}"
                 : "=r"(done)
                 : "r"(bar)
                 : "memory");
}

// `bytes` (a multiple of 16, both ends 16-byte aligned) from global memory
// into shared memory at `to`, completing on `bar`.
__device__ __forceinline__ void bulk_load(uint32_t to, const void* from, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(to),
               "l"(from), "r"(bytes), "r"(bar)
               : "memory");
}

// `bytes` of shared memory at `from` to global memory, in the thread's open
// bulk group (bulk_commit, then bulk_wait_read or bulk_wait).
__device__ __forceinline__ void bulk_store(void* to, uint32_t from, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(to), "r"(from), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Until the committed stores have read their shared memory (it may then be reused or freed).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// Until the committed stores are complete.
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

}  // namespace diag
