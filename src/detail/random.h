// random.h — small, fast, seedable random numbers for sampling (private).
#pragma once

#include <cstdint>

namespace nanguard::detail {

/// One step of splitmix64: a well-mixed 64-bit hash of `x`.
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// Advances `state` and returns the next 64 random bits (splitmix64 stream).
inline uint64_t next_random(uint64_t& state) {
  state += 0x9e3779b97f4a7c15ULL;
  uint64_t z = state;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/// A uniform double in [0, 1) from `state`.
inline double next_uniform(uint64_t& state) {
  return double(next_random(state) >> 11) * 0x1.0p-53;
}

}  // namespace nanguard::detail
