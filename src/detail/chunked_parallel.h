// chunked_parallel.h — at::parallel_for with chunks handed out as threads ask.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace nanguard::detail {

/// Calls `fn(c)` for every c in [0, chunks) on at::parallel_for's threads.
///
/// at::parallel_for gives each thread a fixed share, so the region lasts as
/// long as the thread that woke last needs for its share. Here each thread
/// takes the next chunk when it is free, and the threads that start first
/// do the work of the late ones: on 2 cores with OMP_WAIT_POLICY=passive a
/// worker wakes tens of microseconds late, a third of a census of 2^20 floats.
/// `fn` runs once per chunk, in no particular order, on any thread.
template <typename F>
void for_each_chunk(int64_t chunks, const F& fn) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) fn(c);
  });
}

}  // namespace nanguard::detail
