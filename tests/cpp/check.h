// A minimal test harness: named cases, CHECK/CHECK_EQ/CHECK_THROWS_MSG, one
// failure count, exit code 77 (ctest's SKIP_RETURN_CODE) for skipped suites.
#pragma once

#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <vector>

namespace test {

struct Case {
  const char* name;
  std::function<void()> fn;
};
inline std::vector<Case>& cases() {
  static std::vector<Case> all;
  return all;
}
inline int& failures() {
  static int n = 0;
  return n;
}
struct Register {
  Register(const char* name, std::function<void()> fn) { cases().push_back({name, std::move(fn)}); }
};

inline void fail(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: FAILED: %s\n", file, line, what.c_str());
  ++failures();
}

inline int run_all() {
  for (const Case& c : cases()) {
    const int before = failures();
    try {
      c.fn();
    } catch (const std::exception& e) {
      fail(__FILE__, __LINE__, std::string("unexpected exception: ") + e.what());
    }
    std::printf("%s %s\n", failures() == before ? "[ ok ]" : "[FAIL]", c.name);
  }
  std::printf("%zu cases, %d failed checks\n", cases().size(), failures());
  return failures() == 0 ? 0 : 1;
}

}  // namespace test

#define TEST_CAT2(a, b) a##b
#define TEST_CAT(a, b) TEST_CAT2(a, b)
#define TEST_CASE(name)                                                                    \
  static void TEST_CAT(test_fn_, __LINE__)();                                              \
  static test::Register TEST_CAT(test_reg_, __LINE__)(name, TEST_CAT(test_fn_, __LINE__)); \
  static void TEST_CAT(test_fn_, __LINE__)()

#define CHECK(cond)                                     \
  do {                                                  \
    if (!(cond)) test::fail(__FILE__, __LINE__, #cond); \
  } while (0)

#define CHECK_EQ(a, b)                                                          \
  do {                                                                          \
    const auto& _a = (a);                                                       \
    const auto& _b = (b);                                                       \
    if (!(_a == _b)) test::fail(__FILE__, __LINE__, std::string(#a " == " #b)); \
  } while (0)

// The statement must throw exactly ExcType with exactly `msg` as what().
#define CHECK_THROWS_MSG(ExcType, stmt, msg)                                                           \
  do {                                                                                                 \
    bool _thrown = false;                                                                              \
    try {                                                                                              \
      stmt;                                                                                            \
    } catch (const ExcType& _e) {                                                                      \
      _thrown = true;                                                                                  \
      if (std::string(_e.what()) != std::string(msg))                                                  \
        test::fail(__FILE__, __LINE__, std::string("message '") + _e.what() + "' != '" + (msg) + "'"); \
    }                                                                                                  \
    if (!_thrown) test::fail(__FILE__, __LINE__, std::string("no " #ExcType " from " #stmt));          \
  } while (0)

#define TEST_MAIN() \
  int main() { return test::run_all(); }
