// remedy_check.h — whether a finding's remedy would have kept its step
// finite: the guard runs the failing step again with the remedy applied
// (inside that replay only) and records what came out on the finding.
//
// The remedies are the mechanical forms of the diagnosis's advice: an LR cut
// from the last calm snapshot, a lower loss scale, the batch without its
// non-finite rows, the producing op in float32, a safe softmax, an eps on a
// zero denominator, a clamp before log / sqrt / pow / acos / exp. Where
// several apply they are tried in that order; the first that keeps the step
// finite is the one to take (verified_remedy).
//
//   for (const nanguard::remedy_check& c : finding.remedy_checks)
//     std::cout << to_string(c) << "\n";
//   // verified finite: eps 1e-05 on the zero denominators of aten::div (replayed loss 0.52)
#pragma once

#include <limits>
#include <string>
#include <vector>

namespace nanguard {

/// A remedy the guard can apply inside a replay of the failing step.
enum class remedy_kind {
  none,             ///< no mechanical remedy for the cause (the check says why)
  lr_cut,           ///< the last calm snapshot's weights, one step at a cut LR
  loss_scale_cut,   ///< a lower loss scale (mixed precision)
  skip_rows,        ///< the batch without its non-finite rows
  float32,          ///< the producing op (and what mixes with its output) in float32
  safe_softmax,     ///< softmax with 0 for a row that has no finite entry
  denominator_eps,  ///< an eps in place of the zeros of a denominator
  clamp_input,      ///< the op's input clamped into its finite domain
};

/// What the replay with the remedy gave.
enum class check_result {
  finite,           ///< the loss and every gradient finite: the remedy works
  still_nonfinite,  ///< the remedy is not enough (the check's detail names what stayed bad)
  not_checkable,    ///< the remedy cannot be applied in a replay (the detail says why)
};

/// Every remedy kind, in declaration order.
inline constexpr remedy_kind all_remedy_kinds[] = {
    remedy_kind::none,         remedy_kind::lr_cut,          remedy_kind::loss_scale_cut, remedy_kind::skip_rows,
    remedy_kind::float32,      remedy_kind::safe_softmax,    remedy_kind::denominator_eps,
    remedy_kind::clamp_input};
/// Every check result, in declaration order.
inline constexpr check_result all_check_results[] = {check_result::finite, check_result::still_nonfinite,
                                                     check_result::not_checkable};

/// "none", "lr_cut", "loss_scale_cut", ... (the enum's name).
const char* to_string(remedy_kind k);
/// The remedy kind whose to_string is `name`. Throws c10::Error listing the names for another.
remedy_kind remedy_kind_from_string(const std::string& name);
/// "finite", "still_nonfinite", "not_checkable".
const char* to_string(check_result r);
/// The check result whose to_string is `name`. Throws c10::Error listing the names for another.
check_result check_result_from_string(const std::string& name);

/// One remedy tried on a replay of the failing step, and what came out.
struct remedy_check {
  remedy_kind remedy = remedy_kind::none;  ///< which remedy
  std::string applied;  ///< what the replay changed: "eps 1e-05 on the zero denominators of aten::div"
  check_result result = check_result::not_checkable;  ///< what came out
  /// The loss of the replay with the remedy (the mean over its micro-batches);
  /// NaN when none was computed.
  double loss = std::numeric_limits<double>::quiet_NaN();
  /// still_nonfinite: what stayed bad (the replay's first finding);
  /// not_checkable: why; finite: "" or what the replay needed (rows dropped).
  std::string detail;
};

/// `verified finite: <applied> (replayed loss 0.52)`, `still non-finite:
/// <applied>: <detail>`, `not checkable: <applied or remedy>: <detail>`.
std::string to_string(const remedy_check& c);

/// The first check that came out finite, or null: the remedy to take.
const remedy_check* verified_remedy(const std::vector<remedy_check>& checks);

}  // namespace nanguard
