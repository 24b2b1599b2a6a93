// Validation errors. nanobind maps std::invalid_argument to Python's
// ValueError with the text unchanged, so every documented message is thrown
// as a ValueError from the one place that owns it (src/core).
#pragma once

#include <cstdio>
#include <stdexcept>
#include <string>

namespace attnprep::core {

struct ValueError : std::invalid_argument {
  explicit ValueError(const std::string& message) : std::invalid_argument(message) {}
};

// Throws ValueError(message) unless `ok`. Keeps the checks one line each, in
// the documented order.
inline void require(bool ok, const char* message) {
  if (!ok) throw ValueError(message);
}

// A number in a message, as C's %g prints it: "-1", "1e-06", "nan", "inf".
inline std::string number_str(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

}  // namespace attnprep::core
