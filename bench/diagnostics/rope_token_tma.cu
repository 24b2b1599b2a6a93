// Would a token staged in shared memory by bulk copies (TMA) move
// rope_pool_fused's bytes faster than the library's kernel, whose threads each
// keep one 32-byte item in flight? A prototype of the common shape only:
// bf16 q/k/v of contiguous [T, heads, 128] tensors, NeoX pairs over the whole
// head, cos/sin from a float32 [max_position, 128] cos_sin_cache, flat pools
// [pool, kv_heads, 128] in bf16 or float8_e4m3fn (one float32 scale per
// pool), optionally the QK norm with bf16 weights and the Llama/Qwen3
// rounding. One block of 128 threads per token: one thread
// asks for the token's q, k and v rows and its cache row with four bulk
// copies on one mbarrier (up to 20 KB in flight per block, no registers
// held), the threads rotate (and normalize) the q and k heads in shared
// memory with the library's own device arithmetic (cuda/rope_device.cuh, so
// the results are bit-exact with it; fp8 pool rows are converted into shared
// memory as the library converts them), and one thread writes q_rot, k_rot
// and both pool rows back with bulk stores. Positions must lie inside the cache
// (the library's NaN rows and skipped write for the others are not
// reproduced); slots outside [0, pool_size) skip the pool writes.
//
// A diagnostic for docs/performance-notes.md, not a kernel of the library:
// bench/diagnostics/rope_token_tma.py builds it as a shared library, checks
// it against attnprep.rope_pool_fused and times both.
//   nvcc -O3 -std=c++17 -arch=sm_90 -Isrc -Ibench/diagnostics -shared -Xcompiler -fPIC \
//        bench/diagnostics/rope_token_tma.cu -o /tmp/rope_token_tma.so
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "bulk_copy.cuh"
#include "cuda/rope_device.cuh"

namespace {

using T = __nv_bfloat16;
using namespace attnprep::cuda::rope;

constexpr int kD = 128, kHalf = kD / 2, kW = 8;  // head_dim, pairs, elements per 16 bytes
constexpr int kLanes = kHalf / kW;  // a head's items: one lane each

struct Args {
  const T *q, *k, *v;
  const int64_t *positions, *slots;
  void *k_pool, *v_pool;  // T, or float8_e4m3fn bytes (fp8)
  T *q_out, *k_out;
  const float* cache;  // [max_position, 128]: cos half, sin half
  const T *q_weight, *k_weight;
  const float *k_scale, *v_scale;  // fp8: the pools' dequantization scales
  int64_t pool_size;
  RopePoolParams norm;  // norm_eps and head_dim, for norm_factor_pow2
};

// fp8: a group's elements as e4m3 bytes at `to` (shared memory), x / scale as the library stores them.
__device__ __forceinline__ void to_fp8(const Group<T, kW>& g, unsigned char* to, const attnprep::core::Fp8Quotient& q) {
  store_fp8(g, to, q, 1);
}

template <int HQ, int HKV, bool kNorm, bool kFp8, int kThreads>
__global__ void __launch_bounds__(kThreads) rope_token_kernel(const __grid_constant__ Args a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // bulk copies and mbarrier tx counts: sm_90 on
  constexpr int kQBytes = HQ * kD * 2, kKBytes = HKV * kD * 2, kCsBytes = kD * 4;
  __shared__ alignas(128) T sq[HQ * kD];
  __shared__ alignas(128) T sk[HKV * kD];
  __shared__ alignas(128) T sv[HKV * kD];
  __shared__ alignas(128) float cs[kD];
  __shared__ alignas(128) unsigned char kq[kFp8 ? HKV * kD : 16], vq[kFp8 ? HKV * kD : 16];  // fp8 pool rows
  __shared__ alignas(8) uint64_t bar;
  const int64_t t = blockIdx.x;
  const uint32_t b = diag::smem(&bar);
  if (threadIdx.x == 0) diag::mbarrier_init(b);
  __syncthreads();
  if (threadIdx.x == 0) {
    diag::mbarrier_expect(b, kQBytes + 2 * kKBytes + kCsBytes);
    diag::bulk_load(diag::smem(sq), a.q + t * HQ * kD, kQBytes, b);
    diag::bulk_load(diag::smem(sk), a.k + t * HKV * kD, kKBytes, b);
    diag::bulk_load(diag::smem(sv), a.v + t * HKV * kD, kKBytes, b);
    diag::bulk_load(diag::smem(cs), a.cache + a.positions[t] * kD, kCsBytes, b);
  }
  const int64_t slot = a.slots[t];
  const bool write_pool = slot >= 0 && slot < a.pool_size;
  diag::mbarrier_wait(b);
  constexpr int kPoolRowBytes = kFp8 ? HKV * kD : kKBytes;
  auto* const k_pool_row = static_cast<unsigned char*>(a.k_pool) + slot * kPoolRowBytes;
  auto* const v_pool_row = static_cast<unsigned char*>(a.v_pool) + slot * kPoolRowBytes;
  [[maybe_unused]] attnprep::core::Fp8Quotient k_quotient(1.f), v_quotient(1.f);
  if constexpr (kFp8) {
    k_quotient = attnprep::core::Fp8Quotient(*a.k_scale);
    v_quotient = attnprep::core::Fp8Quotient(*a.v_scale);
    for (int i = threadIdx.x; i < HKV * kD / kW; i += kThreads) {  // v: converted by the threads
      Group<T, kW> g;
      *reinterpret_cast<uint4*>(g.e) = *reinterpret_cast<const uint4*>(sv + i * kW);
      to_fp8(g, vq + i * kW, v_quotient);
    }
  } else {
    if (threadIdx.x == 0 && write_pool) diag::bulk_store(v_pool_row, diag::smem(sv), kKBytes);
  }

  // q and k heads, kLanes items per head (lo: pairs sub * 8 ..., hi: the
  // same + 64): whole warps, so the butterfly has every lane of its warp
  constexpr int kItems = (HQ + HKV) * kLanes;
  static_assert(kItems % 32 == 0, "whole warps of items");
  for (int item = threadIdx.x; item < kItems; item += kThreads) {
    const int head = item / kLanes, sub = item % kLanes;
    const bool is_q = head < HQ;
    T* row = is_q ? sq + head * kD : sk + (head - HQ) * kD;
    const int lo_off = sub * kW, hi_off = kHalf + sub * kW;
    Group<T, kW> lo, hi;
    *reinterpret_cast<uint4*>(lo.e) = *reinterpret_cast<const uint4*>(row + lo_off);
    *reinterpret_cast<uint4*>(hi.e) = *reinterpret_cast<const uint4*>(row + hi_off);
    if constexpr (kNorm) {  // as the library's head_norm_factor and row-path weights
      float lo_sum = group_squares(lo), hi_sum = group_squares(hi);
      for (int off = 1; off < kLanes; off *= 2) {
        lo_sum = __fadd_rn(lo_sum, __shfl_xor_sync(0xffffffffu, lo_sum, off));
        hi_sum = __fadd_rn(hi_sum, __shfl_xor_sync(0xffffffffu, hi_sum, off));
      }
      const float inv = norm_factor_pow2(__fadd_rn(lo_sum, hi_sum), 1.f / kD, a.norm);
      const T* w = is_q ? a.q_weight : a.k_weight;
      normalize_round_then_t_weight(lo, w + lo_off, inv);
      normalize_round_then_t_weight(hi, w + hi_off, inv);
    }
#pragma unroll
    for (int j = 0; j < kW / 2; ++j) {
      const float2 x = lo.get2(j), y = hi.get2(j);
      const int f = sub * kW + 2 * j;
      const float2 r0 = make_float2(cs[f], cs[kHalf + f]), r1 = make_float2(cs[f + 1], cs[kHalf + f + 1]);
      lo.set2(j, rotate_first(x.x, y.x, r0), rotate_first(x.y, y.y, r1));
      hi.set2(j, rotate_second(x.x, y.x, r0), rotate_second(x.y, y.y, r1));
    }
    *reinterpret_cast<uint4*>(row + lo_off) = *reinterpret_cast<const uint4*>(lo.e);
    *reinterpret_cast<uint4*>(row + hi_off) = *reinterpret_cast<const uint4*>(hi.e);
    if constexpr (kFp8) {
      if (!is_q) {
        unsigned char* q8 = kq + (head - HQ) * kD;
        to_fp8(lo, q8 + lo_off, k_quotient);
        to_fp8(hi, q8 + hi_off, k_quotient);
      }
    }
  }
  // the threads' shared-memory writes, visible to the bulk stores
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) {
    diag::bulk_store(a.q_out + t * HQ * kD, diag::smem(sq), kQBytes);
    diag::bulk_store(a.k_out + t * HKV * kD, diag::smem(sk), kKBytes);
    if (write_pool) {
      diag::bulk_store(k_pool_row, diag::smem(kFp8 ? static_cast<void*>(kq) : static_cast<void*>(sk)), kPoolRowBytes);
      if constexpr (kFp8) diag::bulk_store(v_pool_row, diag::smem(vq), kPoolRowBytes);
    }
    diag::bulk_commit();
    diag::bulk_wait_read();  // shared memory must outlive the stores' reads of it
  }
#endif
}

template <int HQ, int HKV, bool kNorm, bool kFp8 = false>
int launch(const Args& a, int64_t tokens, int threads, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(tokens);
  if (threads == 128) rope_token_kernel<HQ, HKV, kNorm, kFp8, 128><<<grid, 128, 0, stream>>>(a);
  else if (threads == 256) rope_token_kernel<HQ, HKV, kNorm, kFp8, 256><<<grid, 256, 0, stream>>>(a);
  else return static_cast<int>(cudaErrorInvalidValue);
  return static_cast<int>(cudaGetLastError());
}

template <int HQ, int HKV, bool kNorm, bool kFp8, int kThreads>
int occupancy() {
  int blocks = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, rope_token_kernel<HQ, HKV, kNorm, kFp8, kThreads>, kThreads, 0);
  return blocks;
}

}  // namespace

// 32 or 64 q heads, 8 kv heads; norm_eps < 0: no QK norm; k_scale and
// v_scale (device pointers) given: float8_e4m3fn pools (32/8 heads, no norm).
// threads: 128 or 256 per block (one block per token). Returns a cudaError_t.
extern "C" int rope_token_tma(const void* q, const void* k, const void* v, const int64_t* positions,
                              const int64_t* slots, void* k_pool, void* v_pool, const float* cache, void* q_out,
                              void* k_out, const void* q_weight, const void* k_weight, const float* k_scale,
                              const float* v_scale, float norm_eps, int64_t tokens, int q_heads, int64_t pool_size,
                              int threads, void* stream) {
  Args a{static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), positions, slots,
         k_pool, v_pool, static_cast<T*>(q_out), static_cast<T*>(k_out), cache,
         static_cast<const T*>(q_weight), static_cast<const T*>(k_weight), k_scale, v_scale, pool_size,
         RopePoolParams{}};
  a.norm.head_dim = kD;
  a.norm.norm_eps = norm_eps;
  const auto s = static_cast<cudaStream_t>(stream);
  if (tokens == 0) return 0;
  const bool norm = norm_eps >= 0.f;
  const int n = threads;
  if (k_scale) return q_heads == 32 && !norm ? launch<32, 8, false, true>(a, tokens, n, s) : int(cudaErrorInvalidValue);
  if (q_heads == 32) return norm ? launch<32, 8, true>(a, tokens, n, s) : launch<32, 8, false>(a, tokens, n, s);
  if (q_heads == 64) return norm ? launch<64, 8, true>(a, tokens, n, s) : launch<64, 8, false>(a, tokens, n, s);
  return static_cast<int>(cudaErrorInvalidValue);
}

// Resident blocks per SM of each instantiation, 128-thread blocks then
// 256: 32/8, 32/8 norm, 64/8, 64/8 norm, 32/8 fp8.
extern "C" void rope_token_tma_occupancy(int* out) {
  out[0] = occupancy<32, 8, false, false, 128>();
  out[1] = occupancy<32, 8, true, false, 128>();
  out[2] = occupancy<64, 8, false, false, 128>();
  out[3] = occupancy<64, 8, true, false, 128>();
  out[4] = occupancy<32, 8, false, true, 128>();
  out[5] = occupancy<32, 8, false, false, 256>();
  out[6] = occupancy<32, 8, true, false, 256>();
  out[7] = occupancy<64, 8, false, false, 256>();
  out[8] = occupancy<64, 8, true, false, 256>();
  out[9] = occupancy<32, 8, false, true, 256>();
}
