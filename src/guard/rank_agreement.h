// rank_agreement.h — how the ranks of a distributed run take one decision
// on a step: the consensus after each rank's sentinel pass (which ranks were
// bad, the global grad norm, the mean loss), the gradient checksums when due,
// the ranks a NaN/Inf came from, and the replay's findings shared with all.
// Every method that runs a collective says so: every rank calls it, in the
// same order.
//
//   rank_agreement ranks(*options.distributed(), sentinel, scaler, options);
//   const bool finite = ranks.agree(record, step) && ranks.checksums_agree(record.event, step);
#pragma once

#include "guard/step_record.h"

#include "nanguard/distributed.h"
#include "nanguard/loss_scaler.h"
#include "nanguard/sentinel.h"

#include <optional>
#include <vector>

namespace nanguard::detail {

/// The guard's side of distributed.h: one decision on every rank.
class rank_agreement {
 public:
  /// REQUIRES: every argument outlives the rank_agreement.
  rank_agreement(distributed& group, const sentinel& sentinel, const loss_scaler& scaler, const guard_options& options);

  /// This rank.
  int64_t rank() const { return group_.rank(); }
  /// The collective the model's own backward runs (DDP, FSDP2), or none.
  backward_collective collective() const { return group_.options().backward(); }

  /// Collective: checks that every rank guards the same parameters.
  void check_same_parameters() const;
  /// Collective: rank 0's `value`, on every rank.
  int64_t rank0s(int64_t value) const;

  /// Collective: the consensus after the local sentinel pass of step `step`.
  /// Fills the event's rank and nonfinite_ranks, and on a step finite
  /// everywhere its mean loss and the grad norm every rank clips by
  /// (averaging the gradients first when the guard does it, which measures
  /// them again into `r.report`). Returns whether the step is finite on
  /// every rank (else the event's reason says where it was not).
  bool agree(step_record& r, int64_t step);
  /// Collective when due (check_every): compares the averaged gradients'
  /// checksums. Returns whether every rank holds the same (the same answer
  /// on every rank); a difference is the event's reason and note, and a warning.
  bool checksums_agree(step_event& e, int64_t step);

  /// Collective: every bad rank broadcasts its replay's verdict and findings
  /// (tagged with its rank); every rank's event gets all of them.
  void share_findings(step_event& e);
  /// Collective under a backward collective, on a bad step whose consensus
  /// named no rank: the consensus of what each rank's replay saw of its own
  /// loss and gradients (`own_bad`; none: there was no replay) names the
  /// ranks the NaN/Inf came from, else the note says why nobody can.
  void name_origin(std::optional<bool> own_bad, step_event& e, int64_t step);
  /// On a rank the NaN/Inf did not come from but whose reduced gradients
  /// hold it: the note says where it came from.
  void note_received(const grad_report& report, step_event& e) const;

  /// Whether the NaN/Inf of bad step `e` came from this rank (one process: yes).
  static bool is_origin(const step_event& e);

 private:
  bool average_and_measure(step_record& r, int64_t step);

  distributed& group_;
  const sentinel& sentinel_;
  const loss_scaler& scaler_;
  const guard_options& options_;
};

}  // namespace nanguard::detail
