// Where a replayed rope_pool_fused call with the QK norm spends its time:
// the rotation kernel built with timestamps (clock64 per warp, globaltimer at
// entry, after the PDL wait and at the end) at its stage boundaries, 20 calls
// replayed as one CUDA graph, the last call's stamps read back. Computing
// cos/sin (the block table behind a barrier) against a float32 cos_sin_cache
// (warp rows), bf16, head_dim 128, 8 kv heads.
//   nvcc -O3 -std=c++17 -arch=sm_90 --expt-relaxed-constexpr -DATTNPREP_WITH_CUDA=1 -I src -I bench/diagnostics \
//     bench/diagnostics/rope_stamps.cu src/cuda/launch.cu src/cuda/rope_norm_pool.cu src/core/*.cpp -o rope_stamps
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

constexpr int kMaxBlocks = 1 << 14;
constexpr int kSlots = 12;  // clock64 at points 0..5, globaltimer at 0, 1, 5
__device__ unsigned long long g_stamps[kMaxBlocks * 2 * kSlots];

// Lane 0 of warps 0 and 3 of every block.
__device__ __forceinline__ void diag_stamp(int point) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane != 0 || (warp != 0 && warp != 3)) return;
  const long long b = blockIdx.x + static_cast<long long>(blockIdx.y) * gridDim.x;
  if (b >= kMaxBlocks) return;
  unsigned long long* s = g_stamps + (b * 2 + (warp == 3)) * kSlots;
  s[point] = clock64();
  if (point == 0 || point == 1 || point == 5) {
    unsigned long long g;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
    s[6 + (point == 0 ? 0 : point == 1 ? 1 : 2)] = g;
  }
}
#define ATTNPREP_ROPE_STAMP(point) ::diag_stamp(point)
#include "../../src/cuda/rope_pool.cu"

#include "core/rope_pool.h"
#include "graph_replay.h"

using attnprep::core::DType;
using attnprep::core::TensorArg;

static TensorArg arg(void* data, std::vector<int64_t> shape, DType dtype, int itemsize) {
  TensorArg t;
  t.data = data;
  t.dtype = dtype;
  t.itemsize = itemsize;
  t.device = {attnprep::core::DeviceType::CUDA, 0};
  t.ndim = static_cast<int32_t>(shape.size());
  int64_t stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.strides[i] = stride;
    stride *= shape[i];
  }
  return t;
}

static void* alloc(size_t bytes, int fill_pattern) {
  void* p;
  CHECK_CUDA(cudaMalloc(&p, bytes));
  std::vector<uint16_t> h(bytes / 2);
  // bfloat16 values in [0.5, 1): hashed low mantissa bits under 0.5's exponent
  for (size_t i = 0; i < h.size(); ++i)
    h[i] = fill_pattern ? static_cast<uint16_t>(0x3f00 | ((i * 2654435761u >> 16) & 0x7f)) : 0;
  CHECK_CUDA(cudaMemcpy(p, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  return p;
}

static double pct(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[static_cast<size_t>(q * (v.size() - 1))];
}

static void run(int64_t T, int64_t hq, bool cache) {
  const int64_t hkv = 8, D = 128, pool = 1 << 20, max_pos = 131072;
  void* q = alloc(T * hq * D * 2, 1);
  void* k = alloc(T * hkv * D * 2, 1);
  void* v = alloc(T * hkv * D * 2, 1);
  void* q_rot = alloc(T * hq * D * 2, 0);
  void* k_rot = alloc(T * hkv * D * 2, 0);
  void* kp = alloc(pool * hkv * D * 2, 0);
  void* vp = alloc(pool * hkv * D * 2, 0);
  std::vector<int64_t> pos(T), slot(T);
  for (int64_t t = 0; t < T; ++t) {
    pos[t] = (t * 104729) % max_pos;
    slot[t] = (t * 7919) & (pool - 1);
  }
  void *dpos, *dslot;
  CHECK_CUDA(cudaMalloc(&dpos, T * 8));
  CHECK_CUDA(cudaMalloc(&dslot, T * 8));
  CHECK_CUDA(cudaMemcpy(dpos, pos.data(), T * 8, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dslot, slot.data(), T * 8, cudaMemcpyHostToDevice));
  void* table = alloc(max_pos * D * 4, 0);
  std::vector<uint16_t> ones(D, 0x3f80);
  void *wq, *wk;
  CHECK_CUDA(cudaMalloc(&wq, D * 2));
  CHECK_CUDA(cudaMalloc(&wk, D * 2));
  CHECK_CUDA(cudaMemcpy(wq, ones.data(), D * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(wk, ones.data(), D * 2, cudaMemcpyHostToDevice));

  attnprep::core::RopePoolArgs a;
  a.q = arg(q, {T, hq, D}, DType::BFloat16, 2);
  a.k = arg(k, {T, hkv, D}, DType::BFloat16, 2);
  a.v = arg(v, {T, hkv, D}, DType::BFloat16, 2);
  a.positions = arg(dpos, {T}, DType::Int64, 8);
  a.slots = arg(dslot, {T}, DType::Int64, 8);
  a.k_pool = arg(kp, {pool, hkv, D}, DType::BFloat16, 2);
  a.v_pool = arg(vp, {pool, hkv, D}, DType::BFloat16, 2);
  a.has_q_norm = a.has_k_norm = true;
  a.q_norm_weight = arg(wq, {D}, DType::BFloat16, 2);
  a.k_norm_weight = arg(wk, {D}, DType::BFloat16, 2);
  a.head_dim = D;
  a.num_qo_heads = hq;
  a.num_kv_heads = hkv;
  if (cache) {
    a.has_cache = true;
    a.cos_sin_cache = arg(table, {max_pos, D}, DType::Float32, 4);
  }
  attnprep::core::check_rope_pool(a);
  const RopePoolParams params = attnprep::core::make_rope_pool_params(
      a, arg(q_rot, {T, hq, D}, DType::BFloat16, 2), arg(k_rot, {T, hkv, D}, DType::BFloat16, 2));
  const attnprep::cuda::RopePoolPointers ptrs{q, k, v, q_rot, k_rot, kp, vp, dpos, dslot, cache ? table : nullptr,
                                               nullptr, nullptr, wq, wk};
  {
    std::vector<unsigned long long> zero(kMaxBlocks * 2 * kSlots, 0);
    CHECK_CUDA(cudaMemcpyToSymbol(g_stamps, zero.data(), zero.size() * 8));
  }
  const double us = replay_us([&](cudaStream_t s) { CHECK_CUDA(attnprep::cuda::rope_pool(params, ptrs, DType::BFloat16, s)); });
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<unsigned long long> st(kMaxBlocks * 2 * kSlots);
  CHECK_CUDA(cudaMemcpyFromSymbol(st.data(), g_stamps, st.size() * 8));
  const int64_t items = attnprep::core::rope_items_per_token(params);
  const int64_t blocks = T * ((items + 127) / 128);  // one-round blocks of 128 threads (T < 1024)
  unsigned long long release = ~0ull, first_entry = ~0ull, end = 0;
  std::vector<double> d[2][5], late[2];
  for (int64_t b = 0; b < blocks; ++b) {
    for (int w = 0; w < 2; ++w) {
      const unsigned long long* s = st.data() + (b * 2 + w) * kSlots;
      if (s[5] == 0) continue;  // this warp had no item
      for (int i = 0; i < 5; ++i) d[w][i].push_back(static_cast<double>(s[i + 1] - s[i]));
      release = std::min(release, s[7]);
      first_entry = std::min(first_entry, s[6]);
      end = std::max(end, s[8]);
    }
  }
  for (int64_t b = 0; b < blocks; ++b)
    for (int w = 0; w < 2; ++w) {
      const unsigned long long* s = st.data() + (b * 2 + w) * kSlots;
      if (s[5]) late[w].push_back(static_cast<double>(s[7] - release));
    }
  std::printf("T=%lld %lld/8 %s: replay %.2f us/call; last call: first entry -> first release %.2f us, "
              "release -> last end %.2f us; post-wait start lag p50/p90 %.0f/%.0f ns\n",
              static_cast<long long>(T), static_cast<long long>(hq), cache ? "cache " : "rope_base", us,
              (release - first_entry) / 1e3, (end - release) / 1e3, pct(late[0], 0.5), pct(late[0], 0.9));
  const char* names[5] = {"entry->wait", "wait->ready", "norm factor", "rows ready", "finish"};
  for (int w = 0; w < 2; ++w) {
    std::printf("  warp %d cycles p50 (p90):", w ? 3 : 0);
    for (int i = 0; i < 5; ++i) std::printf(" %s %.0f (%.0f);", names[i], pct(d[w][i], 0.5), pct(d[w][i], 0.9));
    std::printf("\n");
  }
  for (void* p : {q, k, v, q_rot, k_rot, kp, vp, dpos, dslot, table, wq, wk}) CHECK_CUDA(cudaFree(p));
}

int main() {
  for (int64_t T : {int64_t{128}, int64_t{1}})
    for (int64_t hq : {int64_t{64}, int64_t{32}})
      for (bool cache : {false, true}) run(T, hq, cache);
  return 0;
}
