// The Ulysses send side in one pass (internal): q and k normalized (per head or over a token's heads) and
// rotated, then q, k and v written destination-major into the send buffer [world, S, B, n * D] whose rows are (s, b)
// (the batched layer's layout: its receive buffer views as whole sequences).
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace attnprep::core {

enum UlyssesNorm : int32_t { kSendNoNorm = 0, kSendNormHead = 1, kSendNormToken = 2 };
enum UlyssesRows : int32_t { kSendRowsShared = 0, kSendRowsPerToken = 1, kSendPositions = 2 };

// Strides in elements. Row (s, b) of q is q + b * q_b + s * q_s; head h at + h * q_h.
struct UlyssesSendParams {
  int64_t S, B;
  int64_t q_b, q_s, q_h, k_b, k_s, k_h, v_b, v_s, v_h;
  int64_t table_stride, table_rows;  // cos/sin table [rows, rotary_dim] (cos then sin): elements between rows, rows
  int64_t pos_b, pos_s;              // positions [B, S] (kSendPositions)
  int32_t heads, kv_heads, head_dim, world;
  int32_t local_q, local_kv, n;  // per destination: q heads, kv heads (1 when replicated), heads of a send row
  int32_t norm_q, norm_k;        // UlyssesNorm
  int32_t weight_f32;            // norm weights: 1 float32, 0 q's dtype
  int32_t padded_q, padded_k;    // the norm's width padded to a power of two (head_dim, or heads * head_dim)
  float eps, offset;
  int32_t rotary_dim, is_neox, rows_kind, positions_int64;
  int32_t wire;       // 0: plain [world, S, B, n * D]; else a WireFormat: fp8 wire rows [world, S, B, row_bytes]
  int64_t row_bytes;  // of a wire row
  int64_t text_rows;  // rows s < text_rows take the text norm weights (joint text + image attention)
};

struct UlyssesSendArgs {
  TensorArg q, k, v;  // [B, S, H, D], [B, S, Hkv, D]
  int64_t world = 1;
  bool has_q_norm = false, has_k_norm = false;
  TensorArg q_norm_weight, k_norm_weight;
  int64_t text_rows = 0;  // > 0: the first text_rows rows of each sequence take these weights (same shapes, dtype)
  TensorArg q_text_weight, k_text_weight;
  double eps = 1e-6, offset = 0.0;
  TensorArg cos_sin;  // float32 [rows, rotary_dim]
  bool has_positions = false;
  TensorArg positions;  // [B, S] int32/int64
  int64_t rotary_dim = 0;
  bool is_neox = false;
  int64_t wire = 0;  // 0, or a WireFormat code: then `wire_out` (uint8 [world, S, B, row_bytes]) is written
  TensorArg wire_out;
};

// The checks (internal messages) and the parameters; the plain send buffer's shape in out_shape (wire: unused).
UlyssesSendParams plan_ulysses_send(const UlyssesSendArgs& a, int64_t out_shape[4]);

}  // namespace attnprep::core
