// rank_case.h — what the origin rank of a bad step sends a peer so that the
// peer can run the same step (the cross-rank rerun that tells a faulty
// device from a bug): its class of the fault, its host, the bad
// micro-batch and the CPU RNG state the step began from, as one string for
// distributed::broadcast.
//
//   const rank_case sent = rank_case::from_bytes(d.broadcast(mine ? rank_case{...}.to_bytes() : "", origin));
#pragma once

#include "nanguard/events.h"

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace nanguard::detail {

struct rank_case {
  fault_class fault = fault_class::none;  ///< the origin's class, from its own replay
  std::string host;                      ///< the origin's host name
  std::vector<at::Tensor> batch;         ///< its bad micro-batch (on the CPU)
  at::Tensor rng;                        ///< the CPU generator's state when the step began

  /// The case as bytes (torch's pickle format).
  std::string to_bytes() const;
  /// The case `to_bytes` wrote. Throws c10::Error for other bytes.
  static rank_case from_bytes(const std::string& bytes);
};

/// This machine's host name ("" when it cannot be read).
std::string host_name();

}  // namespace nanguard::detail
