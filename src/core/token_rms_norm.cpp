#include "core/token_rms_norm.h"

#include <cmath>
#include <string>

#include "core/errors.h"
#include "core/overlap.h"

namespace attnprep::core {

void check_token_rms_norm(const TokenNormArgs& a) {
  const TensorArg &x = a.x, &w = a.weight;
  require((x.device.type == DeviceType::CUDA || x.device.type == DeviceType::MPS) && w.device == x.device &&
              a.out.device == x.device,
          "the per-token QK norm (a weight of heads * head_dim) needs its tensors on one CUDA or MPS device");
  if (x.ndim != 3 || !w.has_shape({x.size(1) * x.size(2)}))
    throw ValueError("a per-token q_norm_weight or k_norm_weight must have shape [heads * head_dim] = [" +
                     std::to_string(x.ndim == 3 ? x.size(1) * x.size(2) : 0) + "], got " + shape_str(w));
  if (x.dtype != DType::Float16 && x.dtype != DType::BFloat16 && x.dtype != DType::Float32)
    throw ValueError(std::string("qk_norm_rope supports float16, bfloat16 and float32, got ") + dtype_name(x.dtype));
  if (w.dtype != DType::Float32 && w.dtype != x.dtype)
    throw ValueError(std::string("q_norm_weight and k_norm_weight must be float32 or q's dtype (") +
                     dtype_name(x.dtype) + "), got " + dtype_name(w.dtype));
  require(w.size(0) <= 1 || w.stride(0) == 1, "q_norm_weight and k_norm_weight must be contiguous");
  require(x.stride(-1) == 1 && a.out.stride(-1) == 1, "qk_norm_rope expects q and k to be contiguous in head_dim");
  const float eps32 = static_cast<float>(a.eps);
  if (!(std::isfinite(eps32) && eps32 > 0))
    throw ValueError("norm_eps must be a positive finite number, got " + number_str(a.eps));
  if (!std::isfinite(static_cast<float>(a.offset)))
    throw ValueError("norm_weight_offset must be finite, got " + number_str(a.offset));
  require(x.size(1) * x.size(2) <= (int64_t{1} << 24), "the per-token QK norm supports heads * head_dim <= 2^24");
}

TokenNormParams make_token_rms_norm_params(const TokenNormArgs& a) {
  TokenNormParams p{};
  p.tokens = a.x.size(0);
  p.heads = a.x.size(1);
  p.head_dim = a.x.size(2);
  p.x_stride_token = a.x.stride(0);
  p.x_stride_head = a.x.stride(1);
  p.out_stride_token = a.out.stride(0);
  p.out_stride_head = a.out.stride(1);
  int32_t padded = 1;
  while (padded < p.heads * p.head_dim) padded *= 2;
  p.padded = padded;
  p.weight_f32 = a.weight.dtype == DType::Float32 ? 1 : 0;
  p.eps = static_cast<float>(a.eps);
  p.offset = static_cast<float>(a.offset);
  return p;
}

TokenNormMetalDispatch plan_token_rms_norm_metal(const TokenNormArgs& a) {
  return {make_token_rms_norm_params(a), a.x.size(0), kTokenNormThreads};
}

}  // namespace attnprep::core
