// The 16-byte loads of the copy kernels (the engine's, the flat pack pass's)
// and of the rotation kernel, and its L2 prefetches.
#pragma once

#include <cstdint>

namespace attnprep::cuda {

// A read-only load of V; with kEvictLast an L2 evict-last policy, so that L2 evicts a large copy's written lines
// first (CopyCudaPolicy::large_loads_evict_last).
template <typename V, bool kEvictLast>
__device__ __forceinline__ V load(const V* p) {
  if constexpr (kEvictLast && sizeof(V) == 16) {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    V v;
    asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(policy));
    return v;
  } else {
    return __ldg(p);
  }
}

// Asks L2 for the line at p; with kEvictLast it is marked evict-last, as
// load<V, true> marks its lines.
template <bool kEvictLast>
__device__ __forceinline__ void prefetch_l2(const void* p) {
  if constexpr (kEvictLast)
    asm volatile("prefetch.global.L2::evict_last [%0];\n" ::"l"(p));
  else
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

}  // namespace attnprep::cuda
