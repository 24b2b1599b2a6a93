// Where a replayed rope_pool_fused call with the QK norm spends its time:
// the rotation kernel built with timestamps (clock64 per warp, globaltimer at
// entry, before and after the PDL wait and at the end) at its stage
// boundaries, 20 calls replayed as one CUDA graph, every call's stamps of the
// last replay read back. Computing cos/sin (the block table) against a
// float32 cos_sin_cache (warp rows), and the two in turn (even calls the
// table: whether a gap between calls follows the call that ends or the call
// that waits), bf16, head_dim 128, 8 kv heads. Per call: the stages of the
// last call's warps 0 and 3, and between consecutive calls (globaltimer,
// medians over the replay's calls, every item warp's lane 0 stamping) when
// the next call's first block entered, its first and last warps reached the
// wait and were released, against the previous call's end.
//   nvcc -O3 -std=c++17 -arch=sm_90 --expt-relaxed-constexpr -DATTNPREP_WITH_CUDA=1 -I src -I bench/diagnostics \
//     bench/diagnostics/rope_stamps.cu src/cuda/launch.cu src/cuda/rope_norm_pool.cu src/core/*.cpp -o rope_stamps
//   ./rope_stamps [T ...]   (default 128 1)
// With -DATTNPREP_STAMPS_OFF the kernel has no stamps (graph replay only, to
// compare builds of rope_pool.cu on the same harness).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

constexpr int kCalls = 20;        // the calls replay_us captures in one graph
constexpr int kMaxBlocks = 1024;  // stamped blocks per call: T <= 128 (one-round blocks; 640 at 64/8 heads)
// Points: 0 entry, 1 before the PDL wait, 2 after it, 3 / 4 around the first
// item's norm factor, 5 its warp rows ready, 6 its finish done.
constexpr int kPoints = 7;
constexpr int kSlots = kPoints + 4;  // clock64 at each point, globaltimer at points 0, 1, 2 and 6
constexpr int kWarps = 4;           // per block: every warp's lane 0 stamps
__device__ unsigned long long g_stamps[kCalls * kMaxBlocks * kWarps * kSlots];
// Call c reads its positions at a base aligned to 32 << kCallShift bytes plus
// c << kCallShift (the same values for every call), so the stamp knows its
// call from the pointer alone: no load before the wait.
constexpr int kCallShift = 20;

// Lane 0 of every warp of every block.
__device__ __forceinline__ void diag_stamp(int point, const void* positions) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane != 0 || warp >= kWarps) return;
  const int call = static_cast<int>((reinterpret_cast<uintptr_t>(positions) >> kCallShift) & 31);
  const long long b = blockIdx.x + static_cast<long long>(blockIdx.y) * gridDim.x;
  if (call >= kCalls || b >= kMaxBlocks) return;
  unsigned long long* s = g_stamps + ((static_cast<long long>(call) * kMaxBlocks + b) * kWarps + warp) * kSlots;
  s[point] = clock64();
  if (point <= 2 || point == 6) {
    unsigned long long g;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
    s[kPoints + (point == 6 ? 3 : point)] = g;
  }
}
#ifndef ATTNPREP_STAMPS_OFF
#define ATTNPREP_ROPE_STAMP(point) ::diag_stamp(point, ptr.positions)
#endif
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
  if (!fill_pattern) {
    CHECK_CUDA(cudaMemset(p, 0, bytes));
    return p;
  }
  std::vector<uint16_t> h(bytes / 2);
  // bfloat16 values in [0.5, 1): hashed low mantissa bits under 0.5's exponent
  for (size_t i = 0; i < h.size(); ++i)
    h[i] = static_cast<uint16_t>(0x3f00 | ((i * 2654435761u >> 16) & 0x7f));
  CHECK_CUDA(cudaMemcpy(p, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  return p;
}

static double pct(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[static_cast<size_t>(q * (v.size() - 1))];
}

// Which path each replayed call takes: all the table, all the cache, or the
// two in turn (even calls the table), which tells whether a gap between
// calls follows the call that ends or the call that waits.
enum Mode { kTable, kCache, kAlternate };
static const char* mode_name(int mode) { return mode == kTable ? "rope_base" : mode == kCache ? "cache" : "alternate"; }

static void run(int64_t T, int64_t hq, int mode) {
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
  // each call's positions (diag_stamp: the call from the pointer)
  constexpr size_t kCallBytes = size_t{1} << kCallShift;
  void *dpos_alloc, *dslot;
  CHECK_CUDA(cudaMalloc(&dpos_alloc, 64 * kCallBytes));
  char* dpos = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(dpos_alloc) + 32 * kCallBytes - 1) &
                                       ~(uintptr_t{32 * kCallBytes} - 1));
  CHECK_CUDA(cudaMalloc(&dslot, T * 8));
  for (int c = 0; c < kCalls; ++c)
    CHECK_CUDA(cudaMemcpy(dpos + c * kCallBytes, pos.data(), T * 8, cudaMemcpyHostToDevice));
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
  // [0]: computing cos/sin; [1]: reading the cache
  RopePoolParams params[2];
  for (int c = 0; c < 2; ++c) {
    a.has_cache = c == 1;
    if (c == 1) a.cos_sin_cache = arg(table, {max_pos, D}, DType::Float32, 4);
    attnprep::core::check_rope_pool(a);
    params[c] = attnprep::core::make_rope_pool_params(a, arg(q_rot, {T, hq, D}, DType::BFloat16, 2),
                                                      arg(k_rot, {T, hkv, D}, DType::BFloat16, 2));
  }
  attnprep::cuda::RopePoolPointers ptrs{q, k, v, q_rot, k_rot, kp, vp, dpos, dslot, nullptr,
                                         nullptr, nullptr, wq, wk};
  const auto kind = [&](int c) { return mode == kAlternate ? c % 2 : mode; };
  {
    std::vector<unsigned long long> zero(size_t{kCalls} * kMaxBlocks * kWarps * kSlots, 0);
    CHECK_CUDA(cudaMemcpyToSymbol(g_stamps, zero.data(), zero.size() * 8));
  }
  int call = 0;  // replay_us captures kCalls launches, in order
  const double us = replay_us([&](cudaStream_t s) {
    const int c = call++ % kCalls;
    ptrs.positions = dpos + c * kCallBytes;
    ptrs.cos_sin_cache = kind(c) == 1 ? table : nullptr;
    CHECK_CUDA(attnprep::cuda::rope_pool(params[kind(c)], ptrs, DType::BFloat16, s));
  });
  CHECK_CUDA(cudaDeviceSynchronize());
  // q_rot's and k_rot's bytes and the pool rows the call writes hashed
  // (FNV-1a): two builds of rope_pool.cu that compute and write the same
  // values print the same hash
  uint64_t hash = 14695981039346656037ull;
  const auto add = [&](const void* from, int64_t bytes) {
    std::vector<unsigned char> h(static_cast<size_t>(bytes));
    CHECK_CUDA(cudaMemcpy(h.data(), from, h.size(), cudaMemcpyDeviceToHost));
    for (unsigned char b : h) hash = (hash ^ b) * 1099511628211ull;
  };
  add(q_rot, T * hq * D * 2);
  add(k_rot, T * hkv * D * 2);
  const int64_t row = hkv * D * 2;
  for (const void* pool_base : {kp, vp})
    for (int64_t t = 0; t < T; ++t) add(static_cast<const char*>(pool_base) + slot[t] * row, row);
#ifdef ATTNPREP_STAMPS_OFF
  std::printf("T=%lld %lld/8 %s: replay %.3f us/call (no stamps), outputs %016llx\n", static_cast<long long>(T),
              static_cast<long long>(hq), mode_name(mode), us, static_cast<unsigned long long>(hash));
#else
  std::vector<unsigned long long> st(size_t{kCalls} * kMaxBlocks * kWarps * kSlots);
  CHECK_CUDA(cudaMemcpyFromSymbol(st.data(), g_stamps, st.size() * 8));
  const int64_t items = attnprep::core::rope_items_per_token(params[0]);
  // one-round blocks of 128 item threads (T < 1024); those past kMaxBlocks have no stamps
  const int64_t blocks = std::min<int64_t>(T * ((items + 127) / 128), kMaxBlocks);
  // Per call (globaltimer, ns, over every warp that had an item): first
  // entry, first and last arrival at the wait, first and last release, last
  // end; the stages of the last call's warps 0 and 3 (clock64 cycles).
  // (globaltimer values differenced as integers: as doubles, ns since the
  // epoch keep only about 256 ns)
  enum { kEntry, kFirstWait, kLastWait, kRelease, kLastRelease, kEnd, kMarks };
  std::vector<std::vector<unsigned long long>> m(kMarks, std::vector<unsigned long long>(kCalls));
  std::vector<double> d[2][kPoints - 1];
  for (int c = 0; c < kCalls; ++c) {
    unsigned long long v[kMarks] = {~0ull, ~0ull, 0, ~0ull, 0, 0};
    for (int64_t b = 0; b < blocks; ++b)
      for (int wi = 0; wi < kWarps; ++wi) {
        const unsigned long long* s = st.data() + ((static_cast<size_t>(c) * kMaxBlocks + b) * kWarps + wi) * kSlots;
        if (s[6] == 0) continue;  // this warp had no item
        v[kEntry] = std::min(v[kEntry], s[kPoints]);
        v[kFirstWait] = std::min(v[kFirstWait], s[kPoints + 1]);
        v[kLastWait] = std::max(v[kLastWait], s[kPoints + 1]);
        v[kRelease] = std::min(v[kRelease], s[kPoints + 2]);
        v[kLastRelease] = std::max(v[kLastRelease], s[kPoints + 2]);
        v[kEnd] = std::max(v[kEnd], s[kPoints + 3]);
        if (c == kCalls - 1 && (wi == 0 || wi == 3))
          for (int i = 0; i + 1 < kPoints; ++i) d[wi == 3][i].push_back(static_cast<double>(s[i + 1] - s[i]));
      }
    for (int k = 0; k < kMarks; ++k) m[k][c] = v[k];
  }
  const auto ns = [](unsigned long long later, unsigned long long earlier) {
    return static_cast<double>(static_cast<long long>(later - earlier));
  };
  // medians over calls 1 ... (of one kind: those taking path `k`) of (mark a
  // of this call) - (mark b of the previous call, or of this one)
  for (int k = 0; k < 2; ++k) {
    if (mode != kAlternate && k != mode) continue;
    const auto med = [&](int a, int b, bool previous) {
      std::vector<double> x;
      for (int c = 1; c < kCalls; ++c)
        if (kind(c) == k) x.push_back(ns(m[a][c], m[b][c - previous]));
      return pct(x, 0.5);
    };
    std::printf("T=%lld %lld/8 %s%s: replay %.2f us/call; medians over calls (ns): release to release %.0f; "
                "against the previous call's end: first entry %.0f, first at the wait %.0f, last at the wait %.0f, "
                "first release %.0f, last release %.0f; previous last release -> first entry %.0f; "
                "first release -> last end %.0f\n",
                static_cast<long long>(T), static_cast<long long>(hq), mode_name(mode),
                mode == kAlternate ? (k ? ", the cache's calls" : ", the table's calls") : "", us,
                med(kRelease, kRelease, true), med(kEntry, kEnd, true), med(kFirstWait, kEnd, true),
                med(kLastWait, kEnd, true), med(kRelease, kEnd, true), med(kLastRelease, kEnd, true),
                med(kEntry, kLastRelease, true), med(kEnd, kRelease, false));
  }
  const char* names[kPoints - 1] = {"prologue", "wait", "wait->norm", "norm factor", "rows ready", "finish"};
  for (int w = 0; w < 2; ++w) {
    std::printf("  last call, warp %d cycles p50 (p90):", w ? 3 : 0);
    for (int i = 0; i + 1 < kPoints; ++i) std::printf(" %s %.0f (%.0f);", names[i], pct(d[w][i], 0.5), pct(d[w][i], 0.9));
    std::printf("\n");
  }
#endif
  for (void* p : {q, k, v, q_rot, k_rot, kp, vp, dpos_alloc, dslot, table, wq, wk}) CHECK_CUDA(cudaFree(p));
}

// Arguments: the token counts (default 128 and 1; with stamps at most the
// calls that fit kMaxBlocks).
int main(int argc, char** argv) {
  std::vector<int64_t> tokens;
  for (int i = 1; i < argc; ++i) tokens.push_back(std::atoll(argv[i]));
  if (tokens.empty()) tokens = {128, 1};
  for (int64_t T : tokens)
    for (int64_t hq : {int64_t{64}, int64_t{32}})
      for (int mode : {kTable, kCache, kAlternate}) run(T, hq, mode);
  return 0;
}
