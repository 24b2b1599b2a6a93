#include "core/ulysses_send.h"

#include <utility>

#include "core/errors.h"
#include "core/pack_qkv.h"
#include "core/wire.h"

namespace attnprep::core {

namespace {
int64_t pow2_at_least(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}
bool is_pow2(int64_t n) { return n > 0 && (n & (n - 1)) == 0; }
}  // namespace

UlyssesSendParams plan_ulysses_send(const UlyssesSendArgs& a, int64_t out_shape[4]) {
  const TensorArg &q = a.q, &k = a.k, &v = a.v;
  check_ulysses_batched(q, k, v, nullptr);
  require(q.device.type == DeviceType::CUDA, "ulysses_send: expects CUDA tensors");
  require(q.dtype == DType::Float16 || q.dtype == DType::BFloat16 || q.dtype == DType::Float32,
          "ulysses_send: supports float16, bfloat16 and float32");
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), Hkv = k.size(2), D = q.size(3);
  const int64_t G = 16 / q.itemsize, gph = D / G;
  require(a.world >= 1 && H % a.world == 0 && (Hkv % a.world == 0 || a.world % Hkv == 0),
          "ulysses_send: world_size must divide the q heads, and divide or be a multiple of the kv heads");
  require(D % G == 0 && is_pow2(gph) && gph <= 32,
          "ulysses_send: head_dim x itemsize must be 16 bytes times a power of two up to 32");
  require(H * gph <= 4 * 256 && Hkv * gph <= 4 * 256, "ulysses_send: at most 1024 16-byte groups of q or k per row");
  for (const TensorArg* t : {&q, &k, &v})
    require(t->stride(3) == 1 && t->stride(0) % G == 0 && t->stride(1) % G == 0 && t->stride(2) % G == 0 &&
                reinterpret_cast<uintptr_t>(t->data) % 16 == 0,
            "ulysses_send: q, k and v need 16-byte aligned head rows");
  require(a.rotary_dim >= 2 && a.rotary_dim <= D && a.rotary_dim % G == 0 && a.rotary_dim % 2 == 0,
          "ulysses_send: rotary_dim must be even, a multiple of 16 bytes' elements, at most head_dim");
  require(!a.is_neox || (a.rotary_dim / 2 % G == 0 && is_pow2(a.rotary_dim / 2 / G)),
          "ulysses_send: NeoX halves must be whole groups, a power of two of them");
  const TensorArg& cs = a.cos_sin;
  require(cs.dtype == DType::Float32 && cs.ndim == 2 && cs.size(1) == a.rotary_dim && cs.stride(1) == 1 &&
              cs.device == q.device,
          "ulysses_send: cos_sin must be float32 [rows, rotary_dim] on q's device, unit stride");
  UlyssesSendParams p{};
  p.S = S;
  p.B = B;
  p.q_b = q.stride(0), p.q_s = q.stride(1), p.q_h = q.stride(2);
  p.k_b = k.stride(0), p.k_s = k.stride(1), p.k_h = k.stride(2);
  p.v_b = v.stride(0), p.v_s = v.stride(1), p.v_h = v.stride(2);
  p.table_stride = cs.stride(0);
  p.table_rows = cs.size(0);
  if (a.has_positions) {
    const TensorArg& pos = a.positions;
    require((pos.dtype == DType::Int32 || pos.dtype == DType::Int64) && pos.ndim == 2 && pos.size(0) == B &&
                pos.size(1) == S && pos.device == q.device,
            "ulysses_send: positions must be int32 or int64 [B, S] on q's device");
    p.rows_kind = kSendPositions;
    p.pos_b = pos.stride(0), p.pos_s = pos.stride(1);
    p.positions_int64 = pos.dtype == DType::Int64;
  } else {
    require(cs.size(0) == S || cs.size(0) == B * S, "ulysses_send: without positions, cos_sin holds S or B * S rows");
    p.rows_kind = cs.size(0) == S ? kSendRowsShared : kSendRowsPerToken;  // S rows: every batch item reads them
  }
  p.heads = static_cast<int32_t>(H);
  p.kv_heads = static_cast<int32_t>(Hkv);
  p.head_dim = static_cast<int32_t>(D);
  p.world = static_cast<int32_t>(a.world);
  p.local_q = static_cast<int32_t>(H / a.world);
  p.local_kv = static_cast<int32_t>(Hkv >= a.world ? Hkv / a.world : 1);
  p.n = p.local_q + 2 * p.local_kv;
  const auto norm_kind = [&](bool has, const TensorArg& w, int64_t heads) -> int32_t {
    if (!has) return kSendNoNorm;
    require(w.ndim == 1 && (w.size(0) == D || w.size(0) == heads * D) && w.stride(0) == 1 && w.device == q.device &&
                (w.dtype == DType::Float32 || w.dtype == q.dtype),
            "ulysses_send: a norm weight is [head_dim] or [heads * head_dim], float32 or q's dtype, contiguous");
    require(w.size(0) == D || heads * gph <= 4 * 256, "ulysses_send: at most 1024 16-byte groups of q or k per row");
    return w.size(0) == D ? kSendNormHead : kSendNormToken;  // (one head: the same norm either way)
  };
  p.norm_q = norm_kind(a.has_q_norm, a.q_norm_weight, H);
  p.norm_k = norm_kind(a.has_k_norm, a.k_norm_weight, Hkv);
  require(!(a.has_q_norm && a.has_k_norm) || a.q_norm_weight.dtype == a.k_norm_weight.dtype,
          "ulysses_send: q and k norm weights of one dtype");
  require(a.text_rows >= 0 && a.text_rows <= S, "ulysses_send: text_rows must be in [0, S]");
  if (a.text_rows > 0) {
    require(a.has_q_norm && a.has_k_norm, "ulysses_send: text rows need q and k norm weights");
    for (const auto& [text, base] :
         {std::pair{&a.q_text_weight, &a.q_norm_weight}, {&a.k_text_weight, &a.k_norm_weight}})
      require(text->ndim == 1 && text->size(0) == base->size(0) && text->stride(0) == 1 && text->dtype == base->dtype &&
                  text->device == q.device,
              "ulysses_send: text norm weights must match the norm weights' shape, dtype and device, contiguous");
  }
  p.text_rows = a.text_rows;
  const auto aligned = [](const TensorArg& t) { return reinterpret_cast<uintptr_t>(t.data) % 16 == 0; };
  require(aligned(cs) && cs.stride(0) % 4 == 0 && a.rotary_dim / 2 % 4 == 0 &&
              (!a.has_q_norm || aligned(a.q_norm_weight)) && (!a.has_k_norm || aligned(a.k_norm_weight)) &&
              (a.text_rows == 0 || (aligned(a.q_text_weight) && aligned(a.k_text_weight))),
          "ulysses_send: cos_sin rows, half rows and norm weights must start on 16 bytes");
  const TensorArg& w = a.has_q_norm ? a.q_norm_weight : a.k_norm_weight;
  p.weight_f32 = (a.has_q_norm || a.has_k_norm) && w.dtype == DType::Float32;
  p.padded_q = static_cast<int32_t>(pow2_at_least(p.norm_q == kSendNormToken ? H * D : D));
  p.padded_k = static_cast<int32_t>(pow2_at_least(p.norm_k == kSendNormToken ? Hkv * D : D));
  p.eps = static_cast<float>(a.eps);
  p.offset = static_cast<float>(a.offset);
  p.rotary_dim = static_cast<int32_t>(a.rotary_dim);
  p.is_neox = a.is_neox;
  require(a.wire >= 0 && a.wire <= 2, "ulysses_send: wire must be 0, 1 (e4m3) or 2 (e5m2)");
  p.wire = static_cast<int32_t>(a.wire);
  p.row_bytes = wire_row_bytes(p.n, D);
  if (p.wire != 0) {
    const TensorArg& w = a.wire_out;
    require(w.dtype == DType::UInt8 && w.ndim == 4 && w.size(0) == a.world && w.size(1) == S && w.size(2) == B &&
                w.size(3) == p.row_bytes && w.is_contiguous() && w.device == q.device &&
                reinterpret_cast<uintptr_t>(w.data) % 16 == 0,
            "ulysses_send: wire_out must be uint8 [world, S, B, row_bytes], contiguous, on q's device");
  }
  out_shape[0] = a.world;
  out_shape[1] = S;
  out_shape[2] = B;
  out_shape[3] = p.n * D;
  return p;
}

}  // namespace attnprep::core
