// run_summary.h — what a guarded run did, told to its user: one warning
// line per bad step (a repeat of the same failure says so in a few words,
// without the remedy again) and a summary of the run at its end.
//
// The guard feeds every step event to its narrator (guard::narrator()) and,
// with guard_options::verbose (the default), prints each warning on stderr
// and the summary when it is destroyed after a bad step. Python's Guard
// raises the same lines as nanguard.NanGuardWarning.
//
//   nanguard::run_narrator n;
//   for (const auto& e : nanguard::read_events("train.jsonl")) {
//     const std::string& w = n.observe(e);
//     if (!w.empty()) std::cerr << w << "\n";
//   }
//   std::cerr << n.summary_line() << "\n";
//   // nanguard: step 12: nan from aten::log in head (forward) [log_of_nonpositive]: skipped the step; remedy: ...
//   // nanguard: step 13: nan from aten::log in head (forward) [log_of_nonpositive] again (2nd time): skipped the step
//   // nanguard: 48 steps, 2 not taken (2 skipped); last bad step 13 [log_of_nonpositive]; loss 2.31 (step 1) -> 0.42 (step 48)
#pragma once

#include <nanguard/events.h>

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>

namespace nanguard {

/// What a guarded run did so far, from its step events.
struct run_summary {
  int64_t steps = 0;        ///< training steps (data events not counted)
  int64_t not_taken = 0;    ///< bad steps: the optimizer did not step (every policy)
  int64_t rolled_back = 0;  ///< of those, rolled back
  /// Steps taken after a transient fault: a run of the step from the same
  /// state computed something else, and the step was run again (fault "transient").
  int64_t transient_faults = 0;
  int64_t last_bad_step = -1;  ///< the last bad step (-1: none)
  /// Why the last bad step was bad: its finding's cause ("log_of_nonpositive")
  /// or, without a classified finding, its reason ("non-finite gradient").
  std::string last_cause;
  /// The step a rollback restored last (none: no rollback); initial_step
  /// is the initial weights.
  std::optional<int64_t> last_rollback_to;
  /// When the last step was a rollback: the step whose weights the model
  /// holds now (none: the last step's own, or those of final_step).
  std::optional<int64_t> ended_on_snapshot;
  /// The step number of the initial weights: one before the run's first
  /// step (0 when the steps count from 1).
  int64_t initial_step = 0;
  bool aborted = false;     ///< the run stopped on policy abort (or max_bad_steps)
  int64_t first_step = -1;  ///< the first step the optimizer took (-1: none)
  double first_loss = std::numeric_limits<double>::quiet_NaN();  ///< its loss
  int64_t final_step = -1;  ///< the last step the optimizer took (-1: none)
  double final_loss = std::numeric_limits<double>::quiet_NaN();  ///< its loss
  int64_t last_step = -1;  ///< the last step seen, taken or not (-1: none)
  double loss_scale = 1;    ///< the loss scale of the last step
  double lr = 0;            ///< the LR of the last step
  double first_lr = 0;      ///< the LR of the first step
  /// auto_fix: the op rewrite kept in force ("" none), and the step from which.
  std::string auto_fix;
  int64_t auto_fix_since = -1;
};

/// Whether the run had something to tell: a step not taken, or a transient fault.
inline bool eventful(const run_summary& s) { return s.not_taken > 0 || s.transient_faults > 0; }

/// One line: `nanguard: 48 steps, 2 not taken (2 skipped); last bad step 13
/// [log_of_nonpositive]; loss 2.31 (step 1) -> 0.42 (step 48)`, with the loss
/// scale when it is not 1, and what the user must know: the loss did not
/// fall, the model ended on a snapshot's weights (its initial ones), the
/// last rollback restored the initial weights, the run stopped; after a
/// rollback that cut the LR, the LR the run began and ended with, and the one
/// to start the next run with (`; lr 3 -> 0.0469 (cut by rollbacks): start
/// the next run at lr <= 0.0469`).
std::string to_string(const run_summary& s);

/// Whether `e` is a finite step the guard did not take because its loss or
/// grad norm ran away (its reason: "loss diverging: ..."): no op made a
/// NaN/Inf, and none is named.
bool is_runaway(const step_event& e);

/// How a run ended, from its summary (what `nanguard report` shows): "empty"
/// (no step); "finite" (no bad step); "recovered" (bad steps, and it ended
/// taking steps, its last steps/10 (1 to 10) not all bad, at a finite loss
/// below its first, not on its initial weights (a rollback to initial_step
/// after its last step taken)); "unrecovered" (bad steps, and it ended taking
/// finite steps but not below its first loss, or on its initial weights);
/// "nonfinite" (it stopped on abort, took no step, ended in bad steps, or
/// its last loss was not finite).
const char* run_status(const run_summary& s);

/// Turns step events into warning lines and a run_summary.
class run_narrator {
 public:
  /// Counts `e` and returns its warning line ("" for a step the optimizer
  /// took and for a data event, but for the first of a run of steps with a
  /// forecast: `nanguard: step 12: the loss (3.1e+30) leaves the range
  /// 3.40282e+38 in about 7 steps (x3 a step); lower the LR ...`); also
  /// last_warning() until the next call.
  const std::string& observe(const step_event& e);
  /// The line the last observe() returned.
  const std::string& last_warning() const { return last_warning_; }
  /// The run so far.
  const run_summary& summary() const { return summary_; }
  /// to_string(summary()).
  std::string summary_line() const { return to_string(summary_); }

 private:
  run_summary summary_;
  std::string last_warning_;
  std::map<std::string, int64_t> seen_;  // failure (what + cause) -> how many times
  bool forecasting_ = false;  // the step before had a forecast (warned once until it ends)
};

/// The warning line of bad step `e` seen `times` times (1: the first; a
/// repeat is shorter: "again (3rd time)", no remedy). "" for a step taken.
/// The first ends with what to do: its finding's remedy, or of verdict
/// "compiled only" (no finding) the note: the compiler's stage, its kernel
/// and the remedy.
std::string warning_line(const step_event& e, int64_t times = 1);

}  // namespace nanguard
