#include "cpu/layout_reference.h"

#include <cstring>

namespace attnprep::cpu {
namespace {

const unsigned char* element(const core::TensorArg& t, std::initializer_list<int64_t> idx) {
  int64_t off = 0;
  int d = 0;
  for (int64_t i : idx) off += i * t.strides[d++];
  return static_cast<const unsigned char*>(t.data) + off * t.itemsize;
}

}  // namespace

void pack_qkv_reference(const core::TensorArg& q, const core::TensorArg& k, const core::TensorArg& v,
                        int64_t world_size, const core::TensorArg& out) {
  const int64_t rows = q.shape[0], heads = q.shape[1], dim = q.shape[2];
  const int64_t local = heads / world_size;
  const int64_t es = q.itemsize;
  auto* dst = static_cast<unsigned char*>(out.data);
  const core::TensorArg* src[3] = {&q, &k, &v};
  for (int64_t d = 0; d < world_size; ++d)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < local; ++h)
        for (int which = 0; which < 3; ++which)
          for (int64_t i = 0; i < dim; ++i) {
            const int64_t o = (((d * rows + r) * local + h) * 3 * dim + which * dim + i) * es;
            std::memcpy(dst + o, element(*src[which], {r, d * local + h, i}), es);
          }
}

void usp_merge_heads_reference(const core::TensorArg& x, const core::TensorArg& out) {
  const int64_t W = x.shape[0], S = x.shape[1], B = x.shape[2], H = x.shape[3], D = x.shape[4];
  const int64_t es = x.itemsize;
  auto* dst = static_cast<unsigned char*>(out.data);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int64_t w = 0; w < W; ++w)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t i = 0; i < D; ++i) {
            const int64_t o = ((((b * S + s) * W + w) * H + h) * D + i) * es;
            std::memcpy(dst + o, element(x, {w, s, b, h, i}), es);
          }
}

}  // namespace attnprep::cpu
