// The fp8 wire format of the Ulysses exchange (docs/contract.md): per (destination, row) the n blocks' fp8 values,
// their n float32 scales, zero padding to 16 bytes. The kernels reuse the plain exchange's copy plans with their
// plain-side offsets mapped to wire offsets, so every head geometry comes from the same planners.
#pragma once

#include <cstdint>

#include "core/cuda_tuning.h"
#include "core/fast_divmod.h"
#include "core/strided_copy.h"
#include "core/tensor.h"

namespace attnprep::core {

enum class WireFormat : int32_t { E4M3FN = 1, E5M2 = 2 };  // the layer's wire codes

// Bytes of one wire row of `blocks` blocks of `head_size` values.
constexpr int64_t wire_row_bytes(int64_t blocks, int64_t head_size) {
  return (blocks * head_size + 4 * blocks + 15) / 16 * 16;
}

// Plain-layout byte offset -> wire offsets. The plain layout is rows of
// `blocks` blocks of head_size elements, from `plain_base`.
struct WireMap {
  const unsigned char* plain_base = nullptr;  // where the plan's plain-side pointers start
  unsigned char* wire = nullptr;
  int64_t row_bytes = 0;     // of a wire row
  int64_t values_bytes = 0;  // blocks * head_size: where a wire row's scales start
  int32_t head_size = 0;
  int32_t block_shift = 0;  // log2 of a plain block's bytes
  int32_t item_shift = 0;   // log2 of the plain itemsize
  FastDivmod blocks;        // blocks per row
};

// Where the plain byte at `plain` lands: its fp8 value, its block's scale,
// and the block's place in its row.
ATTNPREP_HD void wire_offsets(const WireMap& m, uint64_t plain, int64_t& value, int64_t& scale, int64_t& slot) {
  const uint64_t block = plain >> m.block_shift;
  const uint32_t row = m.blocks.div(static_cast<uint32_t>(block));
  slot = static_cast<int64_t>(block) - int64_t{row} * m.blocks.divisor;
  const int64_t within = static_cast<int64_t>(plain - (block << m.block_shift)) >> m.item_shift;
  value = row * m.row_bytes + slot * m.head_size + within;
  scale = row * m.row_bytes + m.values_bytes + 4 * slot;
}

// A plan and its map, ready for a kernel (passed by value).
struct WirePlan {
  StridedCopyPlan copy;
  WireMap map;
  DType dtype = DType::BFloat16;  // of the plain side
  WireFormat format = WireFormat::E4M3FN;
  bool quantize = true;  // plain -> wire; false: wire -> plain
};

// Whether the kernels take these tensors: head_size * itemsize a power of two from 32 to 1024 bytes (a block's scale
// reduced by warp shuffles), a 16/32-bit float plain side, 16-byte vectors, fewer than 2^31 plain blocks.
bool wire_kernel_applies(const StridedCopyPlan& plan, DType dtype, int64_t itemsize, int64_t head_size,
                         int64_t plain_blocks);

// The map for a wire buffer of `rows` rows of `blocks` blocks, its plain
// layout starting at `plain_base` (any address the plan was made for).
WireMap make_wire_map(const void* plain_base, void* wire, int64_t blocks, int64_t head_size, int64_t itemsize);

// One job between a 4-D view `x` [A, B, n, head_size] (any strides, unit
// stride in head_size) and its contiguous plain layout at `plain_base`:
// x -> plain when `to_plain`, else plain -> x.
StridedCopyPlan plan_wire_view(const TensorArg& x, const void* plain_base, bool to_plain);

}  // namespace attnprep::core
