// Memory-overlap tests on the bytes tensors address, so that no kernel races with itself (an output over an input
// or another output, or a view addressing one element twice); host arithmetic only.
#pragma once

#include "core/tensor.h"

namespace attnprep::core {

// Whether a byte addressed by `a` is also addressed by `b`: exact for views of one buffer whose dimensions nest,
// true where the search would pass a small budget (a caller refusing on true never races), false when either is
// empty or has no address.
bool may_overlap(const TensorArg& a, const TensorArg& b);

// Whether two different elements of `t` share a byte (a stride of 0, or
// dimensions that interleave); true when undecided, as above.
bool has_internal_overlap(const TensorArg& t);

}  // namespace attnprep::core
