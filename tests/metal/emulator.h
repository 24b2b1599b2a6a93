// Runs a Metal kernel, compiled as C++ through tests/metal/shim, over its
// dispatch grid: threadgroups in shuffled order, the threads of a group as
// real threads started in shuffled order and meeting at threadgroup_barrier.
// Device buffers hold Tracked<E> elements, which record which emulated thread
// stored to them, so two threads writing one element is reported.
#pragma once

#include <metal_stdlib>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdint>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

namespace emu {

inline thread_local long current_thread = -1;
inline std::atomic<long> write_conflicts{0};
inline std::atomic<long> stores{0};

// One device element. A store records its writer; a second writer is a conflict.
template <typename E>
struct Tracked {
  E value{};
  std::atomic<long> writer{-1};

  Tracked() = default;
  explicit Tracked(float f) : value(E(f)) {}
  Tracked(const Tracked& o) : value(o.value) {}
  Tracked& operator=(const Tracked& o) {
    value = o.value;
    const long prev = writer.exchange(current_thread);
    if (prev >= 0 && prev != current_thread) ++write_conflicts;
    ++stores;
    return *this;
  }
  explicit operator float() const { return static_cast<float>(value); }
};

// Calls body(group, lane, threads_per_group) for every thread of the grid.
template <typename Body>
void dispatch(long groups, int threads_per_group, uint32_t seed, Body&& body) {
  std::mt19937 rng(seed);
  std::vector<long> order(static_cast<size_t>(groups));
  std::iota(order.begin(), order.end(), 0L);
  std::shuffle(order.begin(), order.end(), rng);
  for (long g : order) {
    std::barrier<> group_barrier(threads_per_group);
    std::vector<int> lanes(static_cast<size_t>(threads_per_group));
    std::iota(lanes.begin(), lanes.end(), 0);
    std::shuffle(lanes.begin(), lanes.end(), rng);
    std::vector<std::thread> threads;
    for (int lane : lanes)
      threads.emplace_back([&, lane] {
        metal::current_group_barrier = &group_barrier;
        current_thread = g * threads_per_group + lane;
        body(static_cast<uint>(g), static_cast<uint>(lane), static_cast<uint>(threads_per_group));
      });
    for (auto& t : threads) t.join();
  }
}

}  // namespace emu
