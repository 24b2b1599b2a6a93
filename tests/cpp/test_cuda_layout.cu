// The layout kernels on a real GPU against the CPU references (bit-exact,
// poisoned outputs, odd sizes, strided and misaligned sources). Exits 77
// (skipped) when no CUDA device is present.
#include <cuda_runtime_api.h>

#include <cstring>
#include <vector>

#include "check.h"
#include "core/pack_qkv.h"
#include "core/usp_merge_heads.h"
#include "cpu/layout_reference.h"
#include "cuda/strided_copy.h"
#include "gpu_main.h"
#include "tensor_builder.h"

using namespace attnprep::core;
using test::make;
static const Device cuda0{DeviceType::CUDA, 0};

namespace {

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t n) { cudaMalloc(&ptr, n + 16); }
  ~DeviceBuffer() { cudaFree(ptr); }
};

void gpu_pack_matches(int64_t rows, int64_t heads, int64_t dim, int64_t world, DType dtype, int64_t row_pad,
                      int64_t misalign_elems, uint32_t seed) {
  const int es = test::itemsize_of(dtype);
  // q, k, v as slices of one padded buffer [rows, 3 * heads * dim + row_pad]
  const int64_t row = 3 * heads * dim + row_pad;
  TensorArg all = make({rows, row}, dtype);
  test::HostBuffer host;
  host.attach(all, seed, misalign_elems * es);
  const size_t bytes = host.bytes.size();
  DeviceBuffer dall(bytes);
  cudaMemcpy(dall.ptr, host.bytes.data(), bytes, cudaMemcpyHostToDevice);

  TensorArg q = make({rows, heads, dim}, dtype, cuda0, {row, dim, 1}), k = q, v = q;
  auto at = [&](int64_t elem_off, void* base) {
    return static_cast<unsigned char*>(base) + misalign_elems * es + elem_off * es;
  };
  q.data = at(0, dall.ptr);
  k.data = at(heads * dim, dall.ptr);
  v.data = at(2 * heads * dim, dall.ptr);
  auto shape = check_pack_qkv_inputs(q, k, v, world);
  TensorArg out = make({world, rows, heads / world, 3 * dim}, dtype);
  const size_t out_bytes = static_cast<size_t>(out.numel() * es);
  DeviceBuffer dout(out_bytes);
  cudaMemset(dout.ptr, 0xA5, out_bytes + 16);  // poison, including 16 bytes past the end
  out.data = dout.ptr;
  CHECK_EQ(attnprep::cuda::strided_copy(plan_pack_qkv(shape, q, k, v, out), nullptr), cudaSuccess);
  std::vector<unsigned char> got(out_bytes + 16);
  CHECK_EQ(cudaMemcpy(got.data(), dout.ptr, out_bytes + 16, cudaMemcpyDeviceToHost), cudaSuccess);

  TensorArg hq = q, hk = k, hv = v;
  hq.data = at(0, host.bytes.data());
  hk.data = at(heads * dim, host.bytes.data());
  hv.data = at(2 * heads * dim, host.bytes.data());
  std::vector<unsigned char> want(out_bytes + 16, 0xA5);
  TensorArg hout = out;
  hout.data = want.data();
  attnprep::cpu::pack_qkv_reference(hq, hk, hv, world, hout);
  if (got != want)
    test::fail(__FILE__, __LINE__,
               "gpu pack mismatch rows=" + std::to_string(rows) + " dim=" + std::to_string(dim) +
                   " world=" + std::to_string(world) + " es=" + std::to_string(es));
}

void gpu_merge_matches(std::initializer_list<int64_t> shape, std::initializer_list<int64_t> strides, DType dt,
                       uint32_t seed) {
  TensorArg x = make(shape, dt, cuda0, strides);
  test::HostBuffer host;
  host.attach(x, seed);
  DeviceBuffer dx(host.bytes.size());
  cudaMemcpy(dx.ptr, host.bytes.data(), host.bytes.size(), cudaMemcpyHostToDevice);
  int64_t os[5];
  check_usp_merge_heads(x, os);
  TensorArg out = make({os[0], os[1], os[2], os[3], os[4]}, dt);
  const size_t n = static_cast<size_t>(out.numel() * out.itemsize);
  DeviceBuffer dout(n);
  cudaMemset(dout.ptr, 0x5A, n + 16);
  TensorArg dxa = x;
  dxa.data = dx.ptr;
  out.data = dout.ptr;
  CHECK_EQ(attnprep::cuda::strided_copy(plan_usp_merge_heads(dxa, out), nullptr), cudaSuccess);
  std::vector<unsigned char> got(n + 16), want(n + 16, 0x5A);
  CHECK_EQ(cudaMemcpy(got.data(), dout.ptr, n + 16, cudaMemcpyDeviceToHost), cudaSuccess);
  TensorArg hout = out;
  hout.data = want.data();
  attnprep::cpu::usp_merge_heads_reference(x, hout);
  if (got != want) test::fail(__FILE__, __LINE__, "gpu merge mismatch for " + shape_str(x));
}

}  // namespace

TEST_CASE("GPU usp_merge_heads: bit-exact against the reference") {
  gpu_merge_matches({8, 65, 1, 3, 128}, {}, DType::BFloat16, 1);
  gpu_merge_matches({3, 17, 2, 5, 80}, {}, DType::Float16, 2);
  gpu_merge_matches({4, 7, 3, 2, 16}, {2 * 16, 3 * 4 * 2 * 16, 4 * 2 * 16, 16, 1}, DType::Float32, 3);
  gpu_merge_matches({2, 5, 2, 3, 9}, {5 * 2 * 3 * 18, 2 * 3 * 18, 3 * 18, 18, 2}, DType::BFloat16, 4);
  CHECK_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST_CASE("GPU pack: bit-exact against the reference") {
  uint32_t seed = 11;
  for (DType dt : {DType::BFloat16, DType::Float32, DType::Float8E5M2, DType::Float64})
    for (int64_t rows : {1, 17, 65, 300})
      for (int64_t dim : {64, 80, 128, 5})
        for (int64_t world : {1, 2, 8})
          for (int64_t pad : {0, 3})
            for (int64_t mis : {0, 1}) gpu_pack_matches(rows, 8, dim, world, dt, pad, mis, seed++);
  CHECK_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

int main() { return test::run_all_on_gpu(); }
