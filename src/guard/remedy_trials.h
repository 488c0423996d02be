// remedy_trials.h — the remedies of a finding tried on the step that failed:
// each is applied inside a replay of the step only (an op rewrite, a lower
// loss scale, the batch without its non-finite rows, the last calm weights
// and a cut LR), and the replay says whether the step came out finite. The
// guard records the checks on the finding (remedy_check.h); with auto_fix it
// keeps the first verified op rewrite for the rest of the run.
//
//   remedy_trials trials(host, replay, recovery, sentinel, scaler, options);
//   remedy_trials::outcome o = trials.check(record.event.findings.front(), record);
//   finding.remedy_checks = o.checks;
#pragma once

#include "guard/op_patch.h"
#include "guard/recovery.h"
#include "guard/step_record.h"
#include "guard/step_replay.h"

#include "nanguard/finding.h"
#include "nanguard/loss_scaler.h"
#include "nanguard/sentinel.h"
#include "nanguard/training_host.h"

#include <optional>
#include <vector>

namespace nanguard::detail {

/// Tries a finding's remedies on replays of its step.
class remedy_trials {
 public:
  /// What the trials found.
  struct outcome {
    std::vector<remedy_check> checks;  ///< every remedy tried, in order
    /// The op rewrite of the first finite check, when that remedy is one.
    std::optional<op_rewrite> verified_rewrite;
  };

  /// REQUIRES: every argument outlives the trials.
  remedy_trials(training_host& host, step_replay& replay, recovery& recovery, const sentinel& sentinel,
                const loss_scaler& scaler, const guard_options& options);

  /// The remedies of `f`'s cause, tried in order on the step of `r` until one
  /// keeps it finite. `patch_in_force`: auto_fix's kept patch, if any (an op
  /// rewrite cannot be tried beside it). The model, optimizer, gradients and
  /// RNG are as they were before it when it returns.
  outcome check(const finding& f, const step_record& r, const op_patch* patch_in_force);

 private:
  void checks_of(const finding& f, const step_record& r, const op_patch* patch_in_force, outcome& out);
  template <typename Trial>
  remedy_check guarded(remedy_kind kind, Trial trial);
  remedy_check try_rewrite(const op_rewrite& rewrite, const step_record& r, const op_patch* patch_in_force);
  remedy_check try_loss_scales(const step_record& r);
  remedy_check try_without_rows(const step_record& r);
  remedy_check try_lr_cut(const step_record& r);
  remedy_check train_from_snapshot(const step_record& r, double cut);
  remedy_check replayed(remedy_check c, const rerun_outcome& o) const;
  remedy_check unless_running_away(remedy_check c) const;

  training_host& host_;
  step_replay& replay_;
  recovery& recovery_;
  const sentinel& sentinel_;
  const loss_scaler& scaler_;
  const guard_options& options_;
};

}  // namespace nanguard::detail
