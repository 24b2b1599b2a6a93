// Validation errors. nanobind maps std::invalid_argument to Python's
// ValueError with the text unchanged, so every documented message is thrown
// as a ValueError from the one place that owns it (src/core).
#pragma once

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>

namespace attnprep::core {

// `note`: the offending values (dtypes, devices, shapes), which the binding
// attaches as the Python exception's note (PEP 678); the message stays exact.
struct ValueError : std::invalid_argument {
  explicit ValueError(const std::string& message, std::string note_text = {})
      : std::invalid_argument(message), note(std::move(note_text)) {}
  std::string note;
};

// Throws ValueError(message) unless `ok`. Keeps the checks one line each, in
// the documented order.
inline void require(bool ok, const char* message) {
  if (!ok) throw ValueError(message);
}
// The same with a note, built only when the check fails: note() returns it.
template <typename Note>
inline void require(bool ok, const char* message, Note&& note) {
  if (!ok) throw ValueError(message, note());
}

// A number in a message, as C's %g prints it: "-1", "1e-06", "nan", "inf".
inline std::string number_str(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

// The exact decimal product of two counts (up to 128 bits), for messages
// about sizes whose product may exceed 64 bits: schoolbook multiplication
// in base 10^9.
inline std::string product_str(uint64_t a, uint64_t b) {
  constexpr uint64_t kBase = 1000000000;
  const uint64_t x[3] = {a % kBase, a / kBase % kBase, a / kBase / kBase};
  const uint64_t y[3] = {b % kBase, b / kBase % kBase, b / kBase / kBase};
  uint64_t limb[6] = {};  // each sum of partial products stays under 3 * 10^18
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 3; ++j) limb[i + j] += x[i] * y[j];
  for (int k = 0; k < 5; ++k) {
    limb[k + 1] += limb[k] / kBase;
    limb[k] %= kBase;
  }
  std::string s;
  bool leading = true;
  for (int k = 5; k >= 0; --k) {
    if (leading && limb[k] == 0 && k > 0) continue;  // no leading zero limbs
    char buf[16];
    std::snprintf(buf, sizeof buf, leading ? "%llu" : "%09llu", static_cast<unsigned long long>(limb[k]));
    s += buf;
    leading = false;
  }
  return s;
}

}  // namespace attnprep::core
