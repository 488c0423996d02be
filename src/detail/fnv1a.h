// fnv1a.h — the FNV-1a hash over 64-bit words: the one hash behind the
// gradient checksum of a distributed run (distributed.h) and a step's
// signature (step_signature.h).
#pragma once

#include <cstdint>

namespace nanguard::detail {

class fnv1a {
 public:
  void add(uint64_t word) { h_ = (h_ ^ word) * kPrime; }
  uint64_t value() const { return h_; }

 private:
  static constexpr uint64_t kPrime = 1099511628211ull;
  uint64_t h_ = 1469598103934665603ull;
};

}  // namespace nanguard::detail
