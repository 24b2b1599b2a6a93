// Memory-overlap tests on the bytes tensors address, for the checks that keep
// a kernel from racing with itself: an output that overlaps an input or
// another output, or an output view that addresses one element twice. Host
// arithmetic on addresses, shapes and strides only; nothing touches the device.
#pragma once

#include "core/tensor.h"

namespace attnprep::core {

// Whether some byte addressed by `a` is also addressed by `b`. Exact for views
// of one buffer whose dimensions nest (slices, `split`s of a fused projection,
// the k and v halves of one combined cache); where the search would grow past
// a small budget it answers true, so a caller that refuses on true never races.
// False when either tensor is empty or has no address (meta, fake).
bool may_overlap(const TensorArg& a, const TensorArg& b);

// Whether two different elements of `t` share a byte (a stride of 0, or
// dimensions that interleave); true when undecided, as above.
bool has_internal_overlap(const TensorArg& t);

}  // namespace attnprep::core
