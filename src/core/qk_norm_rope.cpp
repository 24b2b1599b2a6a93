#include "core/qk_norm_rope.h"

#include <string>

#include "core/errors.h"

namespace attnprep::core {

void check_qk_norm_rope(const TensorArg& q, const TensorArg& k, const TensorArg* positions, bool mrope) {
  if ((q.ndim != 3 && q.ndim != 4) || k.ndim != q.ndim)
    throw ValueError("qk_norm_rope expects q and k of [T, heads, head_dim] or [B, S, heads, head_dim], got " +
                     shape_str(q) + " and " + shape_str(k));
  const int lead = q.ndim - 2;
  for (int d = 0; d < lead; ++d)
    if (q.size(d) != k.size(d))
      throw ValueError("qk_norm_rope expects q and k with the same leading dimensions, got " + shape_str(q) + " and " +
                       shape_str(k));
  if (positions == nullptr) return;
  bool fits = positions->ndim == lead + (mrope ? 1 : 0) && (!mrope || positions->size(0) == 3);
  std::string want = mrope ? "3" : "";
  for (int d = 0; d < lead; ++d) {
    fits = fits && positions->size(d + (mrope ? 1 : 0)) == q.size(d);
    want += (want.empty() ? "" : ", ") + std::to_string(q.size(d));
  }
  if (!fits) throw ValueError("qk_norm_rope expects positions of shape [" + want + "], got " + shape_str(*positions));
}

}  // namespace attnprep::core
