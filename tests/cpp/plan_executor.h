// Executes a StridedCopyPlan on the host with the very index arithmetic the
// CUDA kernel uses (core::copy_offsets), so the plans are checked in CI
// against the CPU references without a GPU.
#pragma once

#include <cstring>

#include "core/strided_copy.h"

namespace test {

inline void execute_on_host(const attnprep::core::StridedCopyPlan& plan) {
  for (int j = 0; j < plan.njobs; ++j) {
    const auto& job = plan.jobs[j];
    for (int64_t i = 0; i < job.total; ++i) {
      int64_t src, dst;
      if (plan.index_bits == 32)
        attnprep::core::copy_offsets<true>(job, i, plan.vec_bytes, src, dst);
      else
        attnprep::core::copy_offsets<false>(job, i, plan.vec_bytes, src, dst);
      std::memcpy(job.dst + dst, job.src + src, plan.vec_bytes);
    }
  }
}

}  // namespace test
