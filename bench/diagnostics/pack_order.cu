// Does walking pack's output as one flat run of vectors (each output row's
// q | k | v segments in turn), or the inputs' rows in order with each vector
// stored at its output place (as Inductor's kernel for three strided copies
// walks it), beat the copy engine's three interleaved jobs? Each variant copies the same
// inputs, is compared byte for byte with the engine's output, and is timed
// (median of CUDA events over calls rotating between two input sets, each
// several times L2) against cudaMemcpyAsync of the same bytes in the same run.
// At (32768, 24, 128, 8) and (4096, 56, 128, 8) also the flat kernel with the
// whole shape compiled in (fixed_pack), in both orders.
// Then small packs (rows 1, 65, 512 of 8 heads, world 8), where attnprep's
// call timed alone trails Inductor's kernel (docs/performance-notes.md):
// each call timed alone (CUDA events around it, queued behind a spin kernel,
// as bench/ times ops) and under graph replay, for the engine (PDL on and
// off), the flat kernel reading its divisors from the parameter block, and
// the same kernel with the shape compiled in (as Inductor compiles each
// shape), to tell what the engine's start costs.
//   nvcc -O3 -std=c++17 -arch=sm_90 --expt-relaxed-constexpr -Isrc -Ibench/diagnostics \
//     bench/diagnostics/pack_order.cu src/cuda/strided_copy.cu src/cuda/launch.cu src/core/strided_copy.cpp \
//     src/core/pack_qkv.cpp src/core/tensor.cpp src/core/overlap.cpp -o /tmp/pack_order && /tmp/pack_order
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "core/fast_divmod.h"
#include "core/pack_qkv.h"
#include "cuda/launch.h"
#include "cuda/strided_copy.h"
#include "graph_replay.h"

using attnprep::core::FastDivmod;

namespace {

// Output vector i -> (row, segment, vector in segment) -> source vector.
struct FlatPack {
  const uint4* src[3];
  int64_t row_stride[3], head_stride[3];  // in vectors
  uint4* out;
  int64_t total;
  int32_t seg, local, rows, world;  // vectors per segment, local heads, rows, destinations
  FastDivmod by_row3, by_seg, by_local, by_rows, by_world;
};

// kLoad 0: __ldg; 1: L1::evict_last (Triton's eviction_policy='evict_last');
// 2: an L2 evict_last cache policy.
template <int kLoad>
__device__ __forceinline__ uint4 load(const uint4* a) {
  uint4 v;
  if constexpr (kLoad == 0) {
    v = __ldg(a);
  } else if constexpr (kLoad == 1) {
    asm volatile("ld.global.L1::evict_last.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a));
  } else {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a), "l"(policy));
  }
  return v;
}

// kSourceOrder: vector i walks the inputs' order (row outermost, then
// destination, local head, segment), as Inductor's kernel for three strided
// copies does, and is stored at its place in the output; otherwise i is the
// output vector.
template <int kThreads, int kUnroll, int kLoad = 0, bool kSourceOrder = false>
__global__ void __launch_bounds__(kThreads) flat_pack(const __grid_constant__ FlatPack p) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * (kThreads * kUnroll) + threadIdx.x;
  uint4 v[kUnroll];
  bool has[kUnroll];
  int64_t at[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t i = base + u * kThreads;
    has[u] = i < p.total;
    if (has[u]) {
      const uint32_t n = static_cast<uint32_t>(i);
      const uint32_t row = p.by_row3.div(n);
      const uint32_t c = n - row * 3 * p.seg;
      const uint32_t which = p.by_seg.div(c);
      const uint32_t e = c - which * p.seg;
      const uint32_t t = p.by_local.div(row);
      const uint32_t h = row - t * p.local;
      uint32_t d, r;
      if constexpr (kSourceOrder) {
        r = p.by_world.div(t);
        d = t - r * p.world;
        at[u] = ((static_cast<int64_t>(d) * p.rows + r) * p.local + h) * 3 * p.seg + c;
      } else {
        d = p.by_rows.div(t);
        r = t - d * p.rows;
        at[u] = i;
      }
      const int64_t head = static_cast<int64_t>(d) * p.local + h;
      v[u] = load<kLoad>(p.src[which] + r * p.row_stride[which] + head * p.head_stride[which] + e);
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
    if (has[u]) p.out[at[u]] = v[u];
}

// flat_pack with the whole shape compiled in ((kRows, kHeads, 128, kWorld)
// of contiguous q, k, v, kThreads x 1 vector, load kLoad), so every division
// is by a constant and the only parameters are the pointers; walked in
// output order, or in source order as Inductor's kernel for three strided
// copies walks it (kSourceOrder), every vector stored at its output place.
template <int kThreads, int kRows, int kHeads, int kWorld, bool kSourceOrder, int kLoad>
__global__ void __launch_bounds__(kThreads) fixed_pack(const uint4* q, const uint4* k, const uint4* v, uint4* out) {
  constexpr uint32_t kSeg = 16, kLocal = kHeads / kWorld, kTotal = 3u * kRows * kHeads * kSeg;
  const uint32_t i = blockIdx.x * kThreads + threadIdx.x;
  if (i >= kTotal) return;
  const uint32_t row = i / (3 * kSeg), c = i % (3 * kSeg), which = c / kSeg, e = c % kSeg;
  const uint32_t t = row / kLocal, h = row % kLocal;
  uint32_t d, r, o;
  if constexpr (kSourceOrder) {
    r = t / kWorld, d = t % kWorld;
    o = ((d * kRows + r) * kLocal + h) * 3 * kSeg + c;
  } else {
    d = t / kRows, r = t % kRows;
    o = i;
  }
  const uint4* src = which == 0 ? q : which == 1 ? k : v;
  out[o] = load<kLoad>(src + (r * kHeads + d * kLocal + h) * kSeg + e);
}

// A large pack's fixed_pack (128 x 1, L2 evict-last loads as Inductor's,
// world 8) in one order, named for the report.
template <int kRows, int kHeads>
struct FixedLarge {
  const char* name;
  bool source;
  void launch(unsigned blocks, const uint4* q, const uint4* k, const uint4* v, uint4* out) const {
    if (source) fixed_pack<128, kRows, kHeads, 8, true, 2><<<blocks, 128>>>(q, k, v, out);
    else fixed_pack<128, kRows, kHeads, 8, false, 2><<<blocks, 128>>>(q, k, v, out);
  }
};

// About `cycles` clock cycles of one thread: queued ahead of a timed call so
// that the host's launch cost is not in the events' interval.
__global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

__global__ void count_diff(const uint4* a, const uint4* b, int64_t n, unsigned long long* bad) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const uint4 x = a[i], y = b[i];
    if (x.x != y.x || x.y != y.y || x.z != y.z || x.w != y.w) atomicAdd(bad, 1ull);
  }
}

__global__ void fill(uint4* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u + seed;
    p[i] = make_uint4(x, x ^ 0x9e3779b9u, x * 3u, x + seed);
  }
}

// Median ms of `launch(i)` between CUDA events; with spin_cycles, each call
// queued behind a spin kernel of that many cycles (the call timed alone,
// without the host's launch cost in the interval).
template <typename Launch>
float median_ms(Launch launch, int iters = 40, long long spin_cycles = 0) {
  std::vector<float> t;
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 4; ++i) launch(i);
  for (int i = 0; i < iters; ++i) {
    if (spin_cycles) spin<<<1, 1>>>(spin_cycles);
    CHECK_CUDA(cudaEventRecord(a));
    launch(i);
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  return t[t.size() / 2];
}

attnprep::core::TensorArg arg(void* data, int64_t rows, int64_t heads, int64_t dim, int64_t row_stride) {
  attnprep::core::TensorArg t;
  t.data = data;
  t.dtype = attnprep::core::DType::BFloat16;
  t.itemsize = 2;
  t.device = {attnprep::core::DeviceType::CUDA, 0};
  t.ndim = 3;
  t.shape[0] = rows, t.shape[1] = heads, t.shape[2] = dim;
  t.strides[0] = row_stride, t.strides[1] = dim, t.strides[2] = 1;
  return t;
}

// The library's plan for packing q, k, v (bf16 [rows, heads, dim]) into a
// contiguous `out`, as pack_qkv_destination_major makes it.
attnprep::core::StridedCopyPlan engine_plan(const attnprep::core::TensorArg (&qkv)[3], int64_t world, void* out) {
  const auto shape = attnprep::core::check_pack_qkv_inputs(qkv[0], qkv[1], qkv[2], world);
  attnprep::core::TensorArg o = arg(out, 1, 1, 1, 1);
  o.ndim = 4;
  for (int d = 0; d < 4; ++d) o.shape[d] = shape.out_shape[d];
  o.strides[3] = 1, o.strides[2] = o.shape[3], o.strides[1] = o.shape[2] * o.shape[3];
  o.strides[0] = o.shape[1] * o.strides[1];
  return attnprep::core::plan_pack_qkv(shape, qkv[0], qkv[1], qkv[2], o);
}

// flat_pack's parameters for the same pack.
FlatPack flat_plan(const attnprep::core::TensorArg (&qkv)[3], int64_t world, uint4* out) {
  const int64_t rows = qkv[0].shape[0], heads = qkv[0].shape[1], dim = qkv[0].shape[2];
  FlatPack p;
  for (int j = 0; j < 3; ++j) {
    p.src[j] = static_cast<const uint4*>(qkv[j].data);
    p.row_stride[j] = qkv[j].strides[0] * 2 / 16;
    p.head_stride[j] = dim * 2 / 16;
  }
  p.out = out;
  p.seg = static_cast<int32_t>(dim * 2 / 16);
  p.local = static_cast<int32_t>(heads / world);
  p.rows = static_cast<int32_t>(rows);
  p.world = static_cast<int32_t>(world);
  p.total = 3 * rows * heads * dim * 2 / 16;
  p.by_row3 = FastDivmod(3 * p.seg);
  p.by_seg = FastDivmod(p.seg);
  p.by_local = FastDivmod(p.local);
  p.by_rows = FastDivmod(p.rows);
  p.by_world = FastDivmod(p.world);
  return p;
}

template <int T, int U, int L = 0, bool S = false>
void launch_flat(const FlatPack& p) {
  const int64_t blocks = (p.total + T * U - 1) / (T * U);
  flat_pack<T, U, L, S><<<static_cast<unsigned>(blocks), T>>>(p);
}

// 1: every call on the same inputs and output (as a benchmark with one input
// set does); 2: calls alternate between two sets.
int g_sets = 2;

void run_shape(int64_t rows, int64_t heads, int64_t dim, int64_t world, bool fused) {
  const int64_t per = rows * heads * dim;  // elements of one of q, k, v
  const int64_t bytes = 3 * per * 2;
  struct Set {
    uint4* in;
    uint4* out;
  } sets[2];
  for (auto& s : sets) {
    CHECK_CUDA(cudaMalloc(&s.in, bytes));
    CHECK_CUDA(cudaMalloc(&s.out, bytes));
    fill<<<1024, 256>>>(s.in, bytes / 16, 12345u);
  }
  uint4* ref;
  CHECK_CUDA(cudaMalloc(&ref, bytes));
  unsigned long long* bad;
  CHECK_CUDA(cudaMallocManaged(&bad, 8));
  auto tensors = [&](const Set& s, attnprep::core::TensorArg* qkv) {
    auto* b = reinterpret_cast<unsigned char*>(s.in);
    for (int j = 0; j < 3; ++j)
      qkv[j] = fused ? arg(b + j * heads * dim * 2, rows, heads, dim, 3 * heads * dim)
                     : arg(b + j * per * 2, rows, heads, dim, heads * dim);
  };
  auto plan_of = [&](const Set& s, void* out) {
    attnprep::core::TensorArg qkv[3];
    tensors(s, qkv);
    return engine_plan(qkv, world, out);
  };
  auto flat = [&](const Set& s, uint4* out) {
    attnprep::core::TensorArg qkv[3];
    tensors(s, qkv);
    return flat_plan(qkv, world, out);
  };
  const auto ref_plan = plan_of(sets[0], ref);
  CHECK_CUDA(attnprep::cuda::strided_copy(ref_plan, 0));
  const float copy = median_ms([&](int i) { CHECK_CUDA(cudaMemcpyAsync(sets[i % g_sets].out, sets[i % g_sets].in, bytes, cudaMemcpyDeviceToDevice)); });
  std::printf("| (%lld, %lld, %lld, %lld)%s | memcpy %.1f us |", (long long)rows, (long long)heads, (long long)dim,
              (long long)world, fused ? " fused" : "", copy * 1e3);
  auto report = [&](const char* name, auto launch) {
    CHECK_CUDA(cudaMemset(sets[0].out, 0xff, bytes));
    launch(0);
    *bad = 0;
    count_diff<<<1024, 256>>>(sets[0].out, ref, bytes / 16, bad);
    CHECK_CUDA(cudaDeviceSynchronize());
    const float t = median_ms(launch);
    std::printf(" %s %.1f%%%s |", name, 100.0 * copy / t, *bad ? " MISMATCH" : "");
  };
  // plans made before timing, so that the events time the device alone
  const attnprep::core::StridedCopyPlan plans[2] = {plan_of(sets[0], sets[0].out), plan_of(sets[1], sets[1].out)};
  const FlatPack flats[2] = {flat(sets[0], sets[0].out), flat(sets[1], sets[1].out)};
  report("engine", [&](int i) { CHECK_CUDA(attnprep::cuda::strided_copy(plans[i % g_sets], 0)); });
  report("flat 128x1", [&](int i) { launch_flat<128, 1>(flats[i % g_sets]); });
  report("flat 128x1 L1::evict_last", [&](int i) { launch_flat<128, 1, 1>(flats[i % g_sets]); });
  report("flat 128x1 L2 evict_last", [&](int i) { launch_flat<128, 1, 2>(flats[i % g_sets]); });
  report("flat 512x4 L1::evict_last", [&](int i) { launch_flat<512, 4, 1>(flats[i % g_sets]); });
  report("flat 512x4 L2 evict_last", [&](int i) { launch_flat<512, 4, 2>(flats[i % g_sets]); });
  report("source order 128x1", [&](int i) { launch_flat<128, 1, 0, true>(flats[i % g_sets]); });
  report("source order 128x1 L2 evict_last", [&](int i) { launch_flat<128, 1, 2, true>(flats[i % g_sets]); });
  report("source order 512x4 L2 evict_last", [&](int i) { launch_flat<512, 4, 2, true>(flats[i % g_sets]); });
  // the whole shape compiled in, where it is one of these
  const auto fixed = [&](auto kernel) {
    report(kernel.name, [&](int i) {
      const uint4* in = sets[i % g_sets].in;
      const unsigned blocks = static_cast<unsigned>((bytes / 16 + 127) / 128);
      kernel.launch(blocks, in, in + per / 8, in + 2 * per / 8, sets[i % g_sets].out);
    });
  };
  if (!fused && dim == 128 && world == 8 && rows == 32768 && heads == 24) {
    fixed(FixedLarge<32768, 24>{"shape compiled in, source order 128x1 L2 evict_last", true});
    fixed(FixedLarge<32768, 24>{"shape compiled in, output order 128x1 L2 evict_last", false});
  }
  if (!fused && dim == 128 && world == 8 && rows == 4096 && heads == 56) {
    fixed(FixedLarge<4096, 56>{"shape compiled in, source order 128x1 L2 evict_last", true});
    fixed(FixedLarge<4096, 56>{"shape compiled in, output order 128x1 L2 evict_last", false});
  }
  std::printf("\n");
  for (auto& s : sets) {
    CHECK_CUDA(cudaFree(s.in));
    CHECK_CUDA(cudaFree(s.out));
  }
  CHECK_CUDA(cudaFree(ref));
  CHECK_CUDA(cudaFree(bad));
}

template <int kRows>
void run_small() {
  constexpr int64_t heads = 8, dim = 128, world = 8;
  const int64_t per = kRows * heads * dim, bytes = 3 * per * 2;
  uint4 *in, *out, *ref;
  CHECK_CUDA(cudaMalloc(&in, bytes));
  CHECK_CUDA(cudaMalloc(&out, bytes));
  CHECK_CUDA(cudaMalloc(&ref, bytes));
  fill<<<64, 256>>>(in, bytes / 16, 777u);
  unsigned long long* bad;
  CHECK_CUDA(cudaMallocManaged(&bad, 8));
  auto* base = reinterpret_cast<unsigned char*>(in);
  attnprep::core::TensorArg qkv[3];
  for (int j = 0; j < 3; ++j) qkv[j] = arg(base + j * per * 2, kRows, heads, dim, heads * dim);
  const auto ref_plan = engine_plan(qkv, world, ref), plan = engine_plan(qkv, world, out);
  CHECK_CUDA(attnprep::cuda::strided_copy(ref_plan, 0));
  const FlatPack p = flat_plan(qkv, world, out);
  auto report = [&](const char* name, auto launch) {
    CHECK_CUDA(cudaMemset(out, 0xff, bytes));
    launch(0);
    *bad = 0;
    count_diff<<<64, 256>>>(out, ref, bytes / 16, bad);
    CHECK_CUDA(cudaDeviceSynchronize());
    const bool ok = *bad == 0;
    const double alone = 1e3 * median_ms([&](int) { launch(0); }, 200, 1000000);
    const double replay = replay_us([&](cudaStream_t s) { launch(s); });
    std::printf("| %d | %s | %.2f | %.3f | %s |\n", kRows, name, alone, replay, ok ? "equal" : "MISMATCH");
  };
  const auto* q = p.src[0];
  const auto* k = p.src[1];
  const auto* v = p.src[2];
  const unsigned blocks256 = static_cast<unsigned>((p.total + 255) / 256), blocks128 = static_cast<unsigned>((p.total + 127) / 128);
  auto floor = [&](const char* name, auto launch) {  // references without the pack's output
    std::printf("| %d | %s | %.2f | %.3f | |\n", kRows, name, 1e3 * median_ms([&](int) { launch(0); }, 200, 1000000),
                replay_us(launch));
  };
  floor("empty kernel", [](cudaStream_t s) { empty_kernel<<<1, 1, 0, s>>>(); });
  floor("cudaMemcpyAsync of the bytes", [&](cudaStream_t s) {
    CHECK_CUDA(cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, s));
  });
  attnprep::cuda::set_pdl_mode(1);
  report("engine, PDL", [&](cudaStream_t s) { CHECK_CUDA(attnprep::cuda::strided_copy(plan, s)); });
  attnprep::cuda::set_pdl_mode(0);
  report("engine, no PDL", [&](cudaStream_t s) { CHECK_CUDA(attnprep::cuda::strided_copy(plan, s)); });
  report("flat 256x1, divisors from parameters", [&](cudaStream_t s) { flat_pack<256, 1><<<blocks256, 256, 0, s>>>(p); });
  report("flat 128x1, divisors from parameters", [&](cudaStream_t s) { flat_pack<128, 1><<<blocks128, 128, 0, s>>>(p); });
  report("fixed 256x1, shape compiled in", [&](cudaStream_t s) { fixed_pack<256, kRows, 8, 8, false, 0><<<blocks256, 256, 0, s>>>(q, k, v, out); });
  report("fixed 128x1, shape compiled in", [&](cudaStream_t s) { fixed_pack<128, kRows, 8, 8, false, 0><<<blocks128, 128, 0, s>>>(q, k, v, out); });
  attnprep::cuda::set_pdl_mode(-1);
  CHECK_CUDA(cudaFree(in));
  CHECK_CUDA(cudaFree(out));
  CHECK_CUDA(cudaFree(ref));
  CHECK_CUDA(cudaFree(bad));
}

}  // namespace

int main() {
  std::printf("pack variants, %% of cudaMemcpyAsync of the same bytes (same run)\n");
  for (int sets : {1, 2}) {
    g_sets = sets;
    std::printf("calls on %d input set(s)\n", sets);
    run_shape(20992, 56, 128, 2, true);
    run_shape(32768, 24, 128, 8, false);
    run_shape(65536, 48, 128, 8, false);
    run_shape(4096, 56, 128, 8, false);
    run_shape(4096, 56, 128, 8, false);
  }
  std::printf("\nsmall packs (rows, 8, 128, world 8): one call alone (behind a spin kernel) and under graph replay\n");
  std::printf("| rows | kernel | alone us | replay us per call | output |\n|---|---|---|---|---|\n");
  run_small<1>();
  run_small<65>();
  run_small<512>();
  return 0;
}
