// policy.h — what the guard does with a step whose loss or gradients are
// not finite, and its names (the CLI's --policy, Python's policy=).
//
//   nanguard::policy p = nanguard::policy_from_string("rollback");
//   std::cout << nanguard::to_string(p) << "\n";  // rollback
#pragma once

#include <string>

namespace nanguard {

/// What the guard does with a step whose loss or gradients are not finite.
/// In every case the optimizer does not step on it.
enum class policy {
  /// "auto": the action by the diagnosed cause (docs/guard.md's decision
  /// table): bad data is skipped and its batch quarantined, a divergence or
  /// an overflow rolls back and lowers the LR, a loss-scale overflow backs
  /// off, another cause is skipped, and a run that keeps going bad rolls back
  automatic,
  skip,      ///< drop the step (the loss scaler, if enabled, still backs off)
  backoff,   ///< drop the step and back off the loss scale
  rollback,  ///< restore the last snapshot, multiply the LR by rollback_lr_factor
  abort,     ///< write a repro bundle, then throw nonfinite_error
};

/// Every policy, in declaration order.
inline constexpr policy all_policies[] = {policy::automatic, policy::skip, policy::backoff, policy::rollback, policy::abort};
/// "auto", "skip", "backoff", "rollback", "abort".
const char* to_string(policy p);
/// The policy whose to_string is `name`, e.g. "rollback". Throws c10::Error
/// listing the valid names.
policy policy_from_string(const std::string& name);

}  // namespace nanguard
