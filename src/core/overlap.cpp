#include "core/overlap.h"

#include <algorithm>
#include <cstdint>

namespace attnprep::core {
namespace {

// Past this many strides or search steps the answer is "may overlap": the
// layouts the ops are meant for decide within a few dozen steps.
constexpr int64_t kMaxStrideBytes = int64_t{1} << 56;
constexpr int kSearchBudget = 4096;

// A tensor as rows of `row_bytes` contiguous bytes (a unit-stride last
// dimension folded in), placed at base + sum(i_d * stride_d), 0 <= i_d < count_d.
struct Rows {
  int64_t base = 0, row_bytes = 0;
  int n = 0;
  int64_t stride[kMaxDims] = {}, count[kMaxDims] = {};
  bool too_large = false;
};

Rows rows_of(const TensorArg& t) {
  Rows r;
  r.base = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data));
  r.row_bytes = t.itemsize;
  int outer = t.ndim;
  if (t.ndim > 0 && t.stride(-1) == 1) {
    r.row_bytes = t.size(-1) * t.itemsize;
    outer = t.ndim - 1;
  }
  for (int d = 0; d < outer; ++d) {
    if (t.size(d) == 1) continue;
    int64_t s = t.stride(d);
    if (s > kMaxStrideBytes / t.itemsize || -s > kMaxStrideBytes / t.itemsize) r.too_large = true;
    s *= t.itemsize;
    if (s < 0) {  // count from the lowest address instead
      r.base += s * (t.size(d) - 1);
      s = -s;
    }
    r.stride[r.n] = s;
    r.count[r.n] = t.size(d);
    ++r.n;
  }
  return r;
}

bool usable(const TensorArg& t) { return t.has_address && t.ndim <= kMaxDims && t.numel() > 0; }

int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }
int64_t ceil_div(int64_t a, int64_t b) { return -floor_div(-a, b); }

// Is there an x with lo_k <= x_k <= hi_k and L < sum(coef_k * x_k) < H?
// Terms are sorted by coefficient, largest first; the suffix bounds prune
// every value of x_k that the remaining terms cannot bring into range.
struct Term {
  int64_t coef, lo, hi;
};
struct Search {
  Term terms[2 * kMaxDims];
  int64_t rest_min[2 * kMaxDims + 1], rest_max[2 * kMaxDims + 1];
  int n = 0, steps = 0;
  bool undecided = false;

  bool any(int k, int64_t L, int64_t H) {
    if (++steps > kSearchBudget) {
      undecided = true;
      return true;
    }
    if (k == n) return L < 0 && 0 < H;
    const Term& t = terms[k];
    int64_t x_min = floor_div(L - rest_max[k + 1], t.coef) + 1;
    int64_t x_max = ceil_div(H - rest_min[k + 1], t.coef) - 1;
    x_min = std::max(x_min, t.lo);
    x_max = std::min(x_max, t.hi);
    for (int64_t x = x_min; x <= x_max; ++x)
      if (any(k + 1, L - t.coef * x, H - t.coef * x)) return true;
    return false;
  }
};

}  // namespace

bool may_overlap(const TensorArg& a, const TensorArg& b) {
  if (!usable(a) || !usable(b)) return false;
  const Rows ra = rows_of(a), rb = rows_of(b);
  if (ra.too_large || rb.too_large) return true;
  // Rows of a start at base_a + I, rows of b at base_b + J: they share a byte
  // when base_b - base_a - row_a < I - J < base_b - base_a + row_b.
  Search s;
  auto add = [&](int64_t coef, int64_t lo, int64_t hi) {
    for (int i = 0; i < s.n; ++i)
      if (s.terms[i].coef == coef) {  // equal strides: one term, ranges added
        s.terms[i].lo += lo;
        s.terms[i].hi += hi;
        return;
      }
    s.terms[s.n++] = {coef, lo, hi};
  };
  for (int d = 0; d < ra.n; ++d) add(ra.stride[d], 0, ra.count[d] - 1);
  for (int d = 0; d < rb.n; ++d) add(rb.stride[d], -(rb.count[d] - 1), 0);
  std::sort(s.terms, s.terms + s.n, [](const Term& x, const Term& y) { return x.coef > y.coef; });
  // Zero strides add nothing.
  while (s.n > 0 && s.terms[s.n - 1].coef == 0) --s.n;
  s.rest_min[s.n] = s.rest_max[s.n] = 0;
  for (int k = s.n - 1; k >= 0; --k) {
    s.rest_min[k] = s.rest_min[k + 1] + s.terms[k].coef * s.terms[k].lo;
    s.rest_max[k] = s.rest_max[k + 1] + s.terms[k].coef * s.terms[k].hi;
  }
  const int64_t delta = rb.base - ra.base;
  return s.any(0, delta - ra.row_bytes, delta + rb.row_bytes);
}

bool has_internal_overlap(const TensorArg& t) {
  if (!usable(t)) return false;
  Rows r = rows_of(t);
  if (r.too_large) return true;
  // Distinct as long as each dimension, by increasing stride, steps past
  // everything the smaller ones reach.
  int order[kMaxDims];
  for (int i = 0; i < r.n; ++i) order[i] = i;
  std::sort(order, order + r.n, [&](int x, int y) { return r.stride[x] < r.stride[y]; });
  int64_t extent = r.row_bytes;
  for (int i = 0; i < r.n; ++i) {
    const int d = order[i];
    if (r.stride[d] < extent) return true;
    extent += r.stride[d] * (r.count[d] - 1);
  }
  return false;
}

}  // namespace attnprep::core
