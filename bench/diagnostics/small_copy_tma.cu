// Does a bulk-copy (TMA) kernel replay faster than the copy engine's small
// path? Pack at (rows, 8 heads, head 128, world 8) bf16, 20 calls per CUDA
// graph, PDL on, timed like the op benchmarks (median of 5 x 200 replays).
//   engine:  the library's strided copy (core::plan_strided_copy +
//            cuda::strided_copy), as pack_qkv_destination_major runs it;
//   bulk R:  blocks of R threads; a thread owns one (destination, row) of
//            the output: three cp.async.bulk loads of 256 bytes (q, k, v)
//            into shared memory on one mbarrier, then one 768-byte
//            cp.async.bulk store; `read` waits only until shared memory has
//            been read, `full` until the store is complete.
// A diagnostic for the small-shape target (docs/performance-notes.md), not a kernel
// of the library. Every variant's output is compared with the engine's.
//   nvcc -O3 -std=c++17 -arch=sm_90 --expt-relaxed-constexpr -Isrc -Ibench/diagnostics bench/diagnostics/small_copy_tma.cu \
//        src/cuda/strided_copy.cu src/cuda/launch.cu bench/diagnostics/launch_probe.cu src/core/strided_copy.cpp -o /tmp/tma && /tmp/tma
#include <cuda_runtime.h>

#include "bulk_copy.cuh"
#include "core/strided_copy.h"
#include "cuda/launch.h"
#include "launch_probe.h"
#include "cuda/strided_copy.h"
#include "graph_replay.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

using attnprep::cuda::let_next_kernel_start;
using attnprep::cuda::wait_for_prior_kernels;

constexpr int kWorld = 8, kHeads = 8, kHeadBytes = 256, kUnitBytes = 3 * kHeadBytes;

struct BulkPack {
  const unsigned char* src[3];
  unsigned char* dst;
  int rows;
  int units;  // kWorld * rows
};

template <int R, bool kFullWait>
__global__ void __launch_bounds__(R) bulk_pack_kernel(const __grid_constant__ BulkPack p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // bulk copies and mbarrier tx counts: sm_90 on
  __shared__ alignas(128) unsigned char buf[R][kUnitBytes];
  __shared__ alignas(8) uint64_t bar[R];
  let_next_kernel_start();
  const int unit = blockIdx.x * R + threadIdx.x;
  const bool has = unit < p.units;
  const int w = unit / p.rows, r = unit - w * p.rows;
  const uint32_t b = diag::smem(&bar[threadIdx.x]), s = diag::smem(buf[threadIdx.x]);
  if (has) diag::mbarrier_init(b);
  wait_for_prior_kernels();
  if (!has) return;
  diag::mbarrier_expect(b, kUnitBytes);
  for (int j = 0; j < 3; ++j)
    diag::bulk_load(s + j * kHeadBytes, p.src[j] + (static_cast<int64_t>(r) * kHeads + w) * kHeadBytes, kHeadBytes, b);
  diag::mbarrier_wait(b);
  diag::bulk_store(p.dst + static_cast<int64_t>(unit) * kUnitBytes, s, kUnitBytes);  // unit = w * rows + r
  diag::bulk_commit();
  if constexpr (kFullWait)
    diag::bulk_wait();
  else
    diag::bulk_wait_read();
#endif
}

attnprep::core::StridedCopyPlan engine_plan(unsigned char* const src[3], unsigned char* dst, int rows) {
  attnprep::core::CopyJob jobs[3];
  for (int j = 0; j < 3; ++j) {
    attnprep::core::CopyJob& job = jobs[j];
    job.src = src[j];
    job.dst = dst + j * kHeadBytes;
    const int64_t dims[4] = {1, kWorld, rows, 1};
    const int64_t ss[4] = {0, kHeadBytes, kHeads * kHeadBytes, kHeadBytes};
    const int64_t ds[4] = {0, int64_t{rows} * kUnitBytes, kUnitBytes, kUnitBytes};
    std::memcpy(job.dims, dims, sizeof dims);
    std::memcpy(job.src_stride, ss, sizeof ss);
    std::memcpy(job.dst_stride, ds, sizeof ds);
    job.row_bytes = kHeadBytes;
    job.src_elem_stride = 2;
    job.itemsize = 2;
  }
  return attnprep::core::plan_strided_copy(jobs, 3);
}

template <int R, bool kFull>
void run_bulk(const char* name, const BulkPack& p, const std::vector<unsigned char>& expect, double floor) {
  const int blocks = (p.units + R - 1) / R;
  auto launch = [&](cudaStream_t s) {
    CHECK_CUDA(attnprep::cuda::launch_kernel(bulk_pack_kernel<R, kFull>, dim3(blocks), dim3(R), s, p));
  };
  const size_t bytes = static_cast<size_t>(p.units) * kUnitBytes;
  CHECK_CUDA(cudaMemset(p.dst, 0xff, bytes));
  launch(nullptr);
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<unsigned char> got(bytes);
  CHECK_CUDA(cudaMemcpy(got.data(), p.dst, bytes, cudaMemcpyDeviceToHost));
  const bool ok = got == expect;
  const double t = replay_us(launch);
  std::printf("| %d | bulk R=%d %s | %d | %.3f | %.2f | %s |\n", p.rows, R, name, blocks, t, t / floor,
              ok ? "equal" : "MISMATCH");
}

int main() {
  attnprep::cuda::set_pdl_mode(1);
  std::printf("| rows | kernel | blocks | us per call | ratio to empty kernel | output vs engine |\n|---|---|---|---|---|---|\n");
  for (int rows : {1, 65}) {
    const size_t in_bytes = static_cast<size_t>(rows) * kHeads * kHeadBytes, out_bytes = 3 * in_bytes;
    unsigned char* src[3];
    std::vector<unsigned char> host(in_bytes);
    for (int j = 0; j < 3; ++j) {
      CHECK_CUDA(cudaMalloc(&src[j], in_bytes));
      for (size_t i = 0; i < in_bytes; ++i) host[i] = static_cast<unsigned char>(std::rand());
      CHECK_CUDA(cudaMemcpy(src[j], host.data(), in_bytes, cudaMemcpyHostToDevice));
    }
    unsigned char *engine_out, *bulk_out;
    CHECK_CUDA(cudaMalloc(&engine_out, out_bytes));
    CHECK_CUDA(cudaMalloc(&bulk_out, out_bytes));
    const attnprep::core::StridedCopyPlan plan = engine_plan(src, engine_out, rows);
    auto engine = [&](cudaStream_t s) { CHECK_CUDA(attnprep::cuda::strided_copy(plan, s)); };
    CHECK_CUDA(cudaMemset(engine_out, 0xff, out_bytes));
    engine(nullptr);
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<unsigned char> expect(out_bytes);
    CHECK_CUDA(cudaMemcpy(expect.data(), engine_out, out_bytes, cudaMemcpyDeviceToHost));

    const double floor = replay_us([](cudaStream_t s) { empty_kernel<<<1, 1, 0, s>>>(); });
    const double pdl_floor = replay_us([](cudaStream_t s) { CHECK_CUDA(attnprep::cuda::launch_empty_library_kernel(s)); });
    const double t_engine = replay_us(engine);
    std::printf("| %d | empty kernel (no PDL) | 1 | %.3f | 1.00 | |\n", rows, floor);
    std::printf("| %d | empty PDL kernel | 1 | %.3f | %.2f | |\n", rows, pdl_floor, pdl_floor / floor);
    // blocks: the engine's small path runs 256 threads per block (ATTNPREP_COPY_SMALL_THREADS), one vector each
    std::printf("| %d | engine (the library) | %d | %.3f | %.2f | reference |\n", rows,
                static_cast<int>(3 * ((plan.max_total + 255) / 256)), t_engine, t_engine / floor);
    const BulkPack p{{src[0], src[1], src[2]}, bulk_out, rows, kWorld * rows};
    run_bulk<4, true>("full", p, expect, floor);
    run_bulk<8, true>("full", p, expect, floor);
    run_bulk<16, true>("full", p, expect, floor);
    run_bulk<32, true>("full", p, expect, floor);
    run_bulk<4, false>("read", p, expect, floor);
    run_bulk<8, false>("read", p, expect, floor);
    run_bulk<32, false>("read", p, expect, floor);
    const double t_engine_again = replay_us(engine);
    std::printf("| %d | engine again | | %.3f | %.2f | |\n", rows, t_engine_again, t_engine_again / floor);
    for (int j = 0; j < 3; ++j) CHECK_CUDA(cudaFree(src[j]));
    CHECK_CUDA(cudaFree(engine_out));
    CHECK_CUDA(cudaFree(bulk_out));
  }
  return 0;
}
