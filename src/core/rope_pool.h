// rope_pool_fused (docs/contract.md): the checks with the documented
// messages, in order, and the launch parameters. One implementation for the
// CUDA and the Metal backends.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/cuda_tuning.h"
#include "core/fast_divmod.h"  // ATTNPREP_HD
#include "core/rope_pool_params.h"
#include "core/tensor.h"

namespace attnprep::core {

// Paged pools: [pages, page_size, kv_heads, head_dim] (NHD) or [pages,
// kv_heads, page_size, head_dim] (HND); a 3-D pool is [slots, kv_heads,
// head_dim] whatever the layout.
enum class KvLayout : int32_t { NHD, HND };
// "NHD" or "HND"; anything else raises the documented ValueError.
KvLayout parse_kv_layout(const std::string& name);

struct RopePoolArgs {
  TensorArg q, k, v, positions, slots, k_pool, v_pool;
  bool has_positions = true;  // false: token t's position is t (per-token cos_sin_cache rows)
  bool has_pool = true;       // false: no v, slots or pools (q_rot and k_rot only: qk_norm_rope)
  bool has_cache = false;
  TensorArg cos_sin_cache;  // [max_position, rotary_dim], float32 or bfloat16
  bool has_k_scale = false, has_v_scale = false;
  TensorArg k_scale, v_scale;  // fp8 pools: float32, [] / [1] / [num_kv_heads]
  KvLayout kv_layout = KvLayout::NHD;
  bool has_q_norm = false, has_k_norm = false;
  TensorArg q_norm_weight, k_norm_weight;  // [head_dim], float32 or q's dtype
  double norm_eps = 1e-6;
  double norm_offset = 0.0;
  int64_t head_dim = 0, num_qo_heads = 0, num_kv_heads = 0;
  double rope_base = 10000.0;
  bool has_rotary_dim = false;  // false: rotary_dim is head_dim
  int64_t rotary_dim = 0;
  bool is_neox = true;
  bool inplace = false;  // q_rot/k_rot are q/k themselves
  // M-RoPE: positions [3, T] (time, height, width), mrope_section as given (checked: three counts summing to
  // rotary_dim / 2), its frequencies in sections or interleaved (rope_mrope_axis).
  bool has_mrope_section = false;
  std::vector<int64_t> mrope_section;
  bool mrope_interleaved = false;
  bool has_q_scale = false;  // fp8 q: q_rot is float8_e4m3fn, q_rot / q_scale
  TensorArg q_scale;         // float32, [] or [1]

  int64_t rot() const { return has_rotary_dim ? rotary_dim : head_dim; }
  void set_rotary_dim(int64_t r) {
    has_rotary_dim = true;
    rotary_dim = r;
  }
};

// The kernels' index arithmetic is 32-bit within a token and the tokens go
// on the grid's x dimension: these bounds are checked before any launch.
constexpr int64_t kRopeMaxHeads = 65536;  // num_qo_heads + num_kv_heads
constexpr int64_t kRopeMaxTokens = (int64_t{1} << 31) - 1;
constexpr int64_t kRopeMaxPagedSlots = (int64_t{1} << 32) - 1;  // slot -> page is a 32-bit division

// The cache write whole or not at all: v, slots, k_pool and v_pool all given or all None (qk_norm_rope passes
// none), checked as the arguments are read, before check 1; throws ValueError.
void check_cache_write_given(bool v, bool slots, bool k_pool, bool v_pool);

// All checks, in the documented order; throws ValueError.
void check_rope_pool(const RopePoolArgs& a);

// The table's checks (rope_pool_fused's 19-22, mla_rope_pool_fused's 17-20): cos_sin_cache's shape [max_position,
// rotary_dim], dtype and last stride when given, else rope_base.
void check_rope_table(bool has_cache, const TensorArg& cos_sin_cache, int64_t rotary_dim, double rope_base);

// Where a slot's pool row lives, for checked arguments: slot s is page
// s / page_size, offset s % page_size; strides in elements.
struct PoolGeometry {
  int64_t slots, page_size, stride_page, stride_offset, stride_head;
};
PoolGeometry pool_geometry(const TensorArg& pool, KvLayout layout);

// 0: the pools hold q's dtype; 1: float8_e4m3fn; 2: float8_e5m2.
int32_t pool_fp8_kind(DType pool_dtype);

// float32(1 / base^(2i / rotary_dim)) for i < rotary_dim / 2, computed in
// double precision and rounded once, as docs/contract.md defines it.
std::vector<float> rope_inv_freq(double base, int64_t rotary_dim);

// Kernel parameters for checked arguments and the outputs (the inputs when inplace). `vector_bytes`: the widest
// access of the backend (16 on CUDA and Metal); the plan drops to single elements where alignment does not allow it.
RopePoolParams make_rope_pool_params(const RopePoolArgs& a, const TensorArg& q_rot, const TensorArg& k_rot,
                                     int vector_bytes = 16);

// How the Metal kernel (src/metal/rope_pool.metal) is dispatched: one
// threadgroup per token. Built here, once, for the MPS dispatcher
// (python/attnprep/metal.py through the binding) and for the Linux emulation.
struct MetalDispatch {
  RopePoolParams params;
  int64_t threadgroups;
  int32_t threads_per_group;
};
MetalDispatch plan_rope_pool_metal(const RopePoolArgs& a, const TensorArg& q_rot, const TensorArg& k_rot);

// Work items of one token: num_qo_heads + num_kv_heads heads to rotate, then
// num_kv_heads heads of v to copy.
inline int64_t rope_items_per_token(const RopePoolParams& p) {
  return static_cast<int64_t>(p.num_qo_heads + p.num_kv_heads) * p.qk_items_per_head +
         static_cast<int64_t>(p.num_kv_heads) * p.v_items_per_head;
}

// Whether one-round QK-norm blocks on the row path stage their weights and
// cos/sin (RopeCudaPolicy::norm_stage_max_blocks_per_sm); multiprocessors <= 0
// (unknown): no.
inline bool rope_norm_stage(int64_t blocks, int32_t multiprocessors) {
  return multiprocessors > 0 && blocks <= int64_t{RopeCudaPolicy::norm_stage_max_blocks_per_sm} * multiprocessors;
}

// Whether one-round QK-norm blocks computing cos/sin have a table warp: only where the blocks fit in one wave (past
// it the extra warp cost a second wave: 64/8 heads at T = 256, 3.7 vs 4.8 us replayed). Unknown SM count: no.
inline bool rope_table_warp(int64_t blocks, int32_t multiprocessors, bool fp8) {
  const int64_t per_sm =
      fp8 ? RopeCudaPolicy::norm_table_warp_fp8_min_blocks_per_sm : RopeCudaPolicy::norm_table_warp_min_blocks_per_sm;
  return multiprocessors > 0 && blocks <= per_sm * multiprocessors;
}

// The QK-norm kernel's split of one head: `lanes` lanes (a power of two <= 32, within one warp), `per_lane` contiguous
// elements each, so the pairwise sum of squares is a sum in the lane and a butterfly across lanes, one tree.
struct RopeNormSplit {
  int32_t lanes, per_lane;
};
inline RopeNormSplit plan_rope_norm_split(int64_t head_dim, int32_t width) {
  int32_t padded = 1;
  while (padded < head_dim) padded *= 2;
  int32_t per_lane = RopeCudaPolicy::norm_min_groups_per_lane * width;
  if (per_lane < padded / 32) per_lane = padded / 32;
  if (per_lane > padded) per_lane = padded;
  return {padded / per_lane, per_lane};
}

// Whether the rotation kernel does the QK norm itself: its items must be whole blocks of the pairwise sum (16-byte
// groups, full rotary, head_dim a power of two) and a head's items a power of two within a warp.
inline bool rope_norm_in_rotation_kernel(const RopePoolParams& p) {
  const int32_t items = p.qk_items_per_head;
  return p.width > 1 && p.rotary_dim == p.head_dim && (p.head_dim & (p.head_dim - 1)) == 0 && items <= 32 &&
         (items & (items - 1)) == 0;
}

// The shape the CUDA rotation kernel has an instantiation for: NeoX pairs,
// the whole head rotated, `vector` elements per access, and v items of two
// groups half a head apart (core::make_rope_pool_params).
inline bool rope_neox_full(const RopePoolParams& p, int32_t vector) {
  return p.is_neox && p.rotary_dim == p.head_dim && p.width == vector &&
         (p.v_items_per_head == 0 || 2 * p.v_items_per_head * vector == p.head_dim);
}

// The items of a token each of its `splits` blocks serves: an even share, rounded up to whole heads of `lanes`
// items when the rotation kernel does the QK norm, so a head's items are lanes of one warp in one round (unsigned:
// a signed division costs the kernel registers).
ATTNPREP_HD int rope_items_per_block(int n_all, int splits, int lanes) {
  const uint32_t share =
      (static_cast<uint32_t>(n_all) + static_cast<uint32_t>(splits) - 1u) / static_cast<uint32_t>(splits);
  const uint32_t whole = static_cast<uint32_t>(lanes);
  return static_cast<int>((share + whole - 1u) / whole * whole);
}

// The CUDA kernels' divisors, planned on the host per launch: a hardware division by a run-time value is ~20
// instructions and the rotation kernel with the QK norm is issue-bound.
struct RopeCudaIndex {
  FastDivmod qk_items;  // by qk_items_per_head (items < 2^30)
  FastDivmod v_items;   // by v_items_per_head
  FastDivmod page;      // by page_size; slots < 2^32, so div_wide
  int32_t items_per_block;
  // plan_rope_cuda_tail: blocks from whole_tokens on serve the call's last
  // tokens in tail.divisor slices of tail_items_per_block items each.
  uint32_t whole_tokens = UINT32_MAX;
  int32_t tail_items_per_block = 0;
  FastDivmod tail;
};
inline RopeCudaIndex plan_rope_cuda_index(const RopePoolParams& p, int64_t splits, int lanes) {
  RopeCudaIndex ix;
  ix.qk_items = FastDivmod(static_cast<uint32_t>(p.qk_items_per_head));
  ix.v_items = FastDivmod(static_cast<uint32_t>(p.v_items_per_head > 0 ? p.v_items_per_head : 1));
  // A pool of no slots (pages of none, or no pages of any size) divides no
  // slot; otherwise page_size <= pool_size < 2^32.
  ix.page = FastDivmod(static_cast<uint32_t>(p.pool_size > 0 ? p.page_size : 1));
  ix.items_per_block = rope_items_per_block(static_cast<int>(rope_items_per_token(p)), static_cast<int>(splits), lanes);
  return ix;
}

// A call of several-round blocks past one wave would end with a wave of whole tokens running ever fewer side by
// side; its last tokens go in one-round slices instead, dispatched last. Returns the grid's x and fills `ix`'s tail
// (none for one-round tokens, calls within one wave, or an unknown resident count); tail_share > 1 divides it.
inline int64_t plan_rope_cuda_tail(RopeCudaIndex& ix, int64_t items, int64_t num_tokens, int32_t threads, int lanes,
                                   int64_t resident_blocks, int64_t tail_share = 1) {
  const int64_t rounds = (items + threads - 1) / threads;
  if (rounds < 2 || resident_blocks <= 0 || num_tokens <= resident_blocks) return num_tokens;
  int64_t tail = (resident_blocks + rounds * tail_share - 1) / (rounds * tail_share);
  if (tail > num_tokens - resident_blocks) tail = num_tokens - resident_blocks;
  const int64_t blocks = num_tokens + tail * (rounds - 1);
  if (blocks >= kRopeMaxTokens) return num_tokens;  // the grid's x holds at most 2^31 - 1 blocks
  ix.whole_tokens = static_cast<uint32_t>(num_tokens - tail);
  ix.tail = FastDivmod(static_cast<uint32_t>(rounds));
  ix.tail_items_per_block = rope_items_per_block(static_cast<int>(items), static_cast<int>(rounds), lanes);
  return blocks;
}

// Block `block` (>= ix.whole_tokens) of a launch with a tail: its token and
// its slice, items [begin, begin + share). A token's slices run in reverse
// (its last slice in the first block), as split tokens' do.
struct RopeTailSlice {
  uint32_t token;
  int begin, share;
};
ATTNPREP_HD RopeTailSlice rope_tail_slice(const RopeCudaIndex& ix, uint32_t block) {
  const uint32_t b = block - ix.whole_tokens;
  const uint32_t q = ix.tail.div(b);
  const int share = ix.tail_items_per_block;
  return {ix.whole_tokens + q, static_cast<int>(ix.tail.divisor - 1u - (b - q * ix.tail.divisor)) * share, share};
}

// Heads of one token in the QK-norm kernel: q heads, k heads, then v heads (none without pools), each served by
// `lanes` lanes.
ATTNPREP_HD int rope_norm_heads_per_token(const RopePoolParams& p) {
  return p.num_qo_heads + p.num_kv_heads + (p.v_items_per_head > 0 ? p.num_kv_heads : 0);
}
inline int64_t rope_norm_lanes_per_token(const RopePoolParams& p) {
  return static_cast<int64_t>(rope_norm_heads_per_token(p)) * p.norm_lanes;
}

// How the CUDA kernel is launched: a block per token (or slice), the fewest whole warps covering its items in the
// fewest rounds (448 items: 4 rounds of 128 threads), tokens spread over `splits` one-round blocks below split_below;
// `several_rounds` selects the kernel that asks L2 for each thread's next item.
struct RopeCudaLaunch {
  int32_t threads;
  int64_t splits;
  bool several_rounds;
};
inline RopeCudaLaunch plan_rope_cuda_launch(int64_t items, int64_t num_tokens,
                                            int32_t max_threads = RopeCudaPolicy::max_threads,
                                            int64_t split_below = RopeCudaPolicy::split_below) {
  const int64_t rounds = items > max_threads ? (items + max_threads - 1) / max_threads : 1;
  const int64_t per_round = (items + rounds - 1) / rounds;
  int64_t threads = (per_round + 31) / 32 * 32;
  threads = threads < 32 ? 32 : (threads > max_threads ? max_threads : threads);
  // gridDim.y stops at 65535; past that a block walks several rounds.
  const int64_t splits = num_tokens >= split_below ? 1 : (rounds < 65535 ? rounds : 65535);
  const int64_t per_block = (items + splits - 1) / splits;
  return {static_cast<int32_t>(threads), splits, per_block > threads};
}

}  // namespace attnprep::core
