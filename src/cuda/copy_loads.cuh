// The copy kernels' 16-byte loads (the engine's and the flat pack pass's).
#pragma once

#include <cstdint>

namespace attnprep::cuda {

// A read-only load of V; with kEvictLast a 16-byte load carries an L2
// evict-last cache policy, so that a large copy's freshly written output
// lines, not the lines being read, are what L2 evicts first
// (CopyCudaPolicy::large_loads_evict_last).
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

}  // namespace attnprep::cuda
