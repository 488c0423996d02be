// recovery.h — what the guard does about bad steps, and what it keeps to
// do it: the decision table of policy auto (docs/guard.md), the memory of
// bad batches (quarantine), the count of bad steps (max_bad_steps,
// max_bad_fraction), the runaway loss, the snapshot ring and when to take
// one, and the rollback with its LR factor.
//
//   recovery r(host, scaler, options, /*ranks=*/nullptr);
//   r.observe_finite(record.event);            // a finite step: the windows
//   const decision d = r.decide(record);       // a bad one: the policy
//   if (d.policy == policy::rollback) r.roll_back(record.event);
#pragma once

#include "guard/step_record.h"

#include "nanguard/loss_scaler.h"
#include "nanguard/policy.h"
#include "nanguard/snapshot.h"
#include "nanguard/training_host.h"

#include <cmath>
#include <deque>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace nanguard::detail {

class rank_agreement;

/// The policy for a bad step, and why when it is not the table's.
struct decision {
  nanguard::policy policy = nanguard::policy::skip;
  /// Why the run is stopped (max_bad_steps, max_bad_fraction); "" otherwise.
  std::string note;
  /// A rollback: whether it cuts the LR (not for bad data: the LR is not at fault).
  bool cut_lr = true;
};

/// The recovery policy and its state across steps.
class recovery {
 public:
  /// REQUIRES: every argument outlives the recovery; `ranks` (null in one
  /// process) makes every rank snapshot the same steps.
  recovery(training_host& host, const loss_scaler& scaler, const guard_options& options, rank_agreement* ranks);

  // ---- what the steps were

  /// A finite step (its spikes observed): it may run away (below), and then
  /// gets the reason, else its loss and grad norm join the windows a
  /// diagnosis reads and the run's best window.
  void observe_finite(step_event& e);
  /// Whether the finite step observed last runs away, under the policies
  /// that roll back (and spike_rollback_z not 0): its loss is orders of magnitude (runaway_factor) above
  /// the run's best window and its first loss, or its forecast leaves the
  /// dtype's range within 3 steps, or (auto) it is the third in
  /// a row whose loss spiked by spike_rollback_z and to 10 times the median
  /// of the steps before. The guard then rolls back before the NaN/Inf comes.
  bool running_away() const { return runaway_; }
  /// Whether finite step `e` is calm: no spike, its loss within calm_factor
  /// of the run's best window (and its grad norm within calm_norm_factor).
  /// Only a calm step's snapshot is a rollback target.
  bool calm(const step_event& e) const;
  /// A step the optimizer took (resets the bad steps in a row).
  void count_taken();
  /// A step the optimizer did not take.
  void count_not_taken();

  /// auto and rollback in one process: whether the batches of `r` were quarantined; if so
  /// the event gets the findings of the first time and a note, and the step
  /// is not replayed.
  bool quarantined(step_record& r);
  /// auto and rollback in one process: counts a bad step of the batches of
  /// `r`; quarantines them the first time the data itself was bad, or (auto)
  /// the second time. A divergence, an overflow or a loss-scale overflow is the
  /// model's or the LR's: the batch is not blamed.
  void remember_bad_batch(step_record& r);

  // ---- the decision

  /// The policy for bad step `r`: abort when the run keeps going bad, a
  /// rollback when its loss runs away, else the options' (auto: by cause,
  /// docs/guard.md's decision table).
  decision decide(const step_record& r) const;

  // ---- acting

  /// Takes the snapshot of step `step` when one is due and step `e` is calm
  /// (no spike; auto: judged against enough steps). `step_seconds`: what the
  /// step took (the snapshots' time budget).
  void snapshot_if_due(const step_event& e, double step_seconds);
  /// At the run's first step (numbered `first_step`; once, later calls do
  /// nothing): the initial weights are step first_step - 1, and with
  /// `keep_weights` their snapshot is taken, what a rollback (or the check
  /// of an LR cut) can go back to.
  void start(int64_t first_step, bool keep_weights);
  /// Copies the state into the ring now, as the snapshot of `step`.
  void snapshot(int64_t step);
  /// Restores the newest calm snapshot into the host (diverging again from
  /// the one restored last goes one further back) and, with `cut_lr`, cuts
  /// the LR factor: by rollback_lr_factor, then its square, its cube, ... for
  /// each rollback that comes before the run is calm again (a new snapshot).
  /// Returns the cut (1: none; the caller applies it to the LRs). `e` gets
  /// rollback_to and the note of what moved most.
  double roll_back(step_event& e, bool cut_lr = true);

  // ---- what it knows

  /// The losses and grad norms of the last finite steps (a spike window).
  const std::deque<double>& losses() const { return losses_; }
  const std::deque<double>& grad_norms() const { return grad_norms_; }
  /// Whether the snapshots are kept (the policies that roll back).
  bool rolls_back() const;
  int64_t skipped() const { return skipped_; }
  int64_t rollbacks() const { return rollbacks_; }
  int64_t bad_in_a_row() const { return bad_in_a_row_; }
  /// The product of the rollback LR factors so far.
  double lr_factor() const { return lr_factor_; }
  /// What the next `rollbacks` rollbacks that cut the LR would cut it by together (roll_back).
  double lr_cut_after(int64_t rollbacks) const {
    const double n = double(cuts_in_a_row_);  // each cuts by the factor to the power of its rank
    const double k = double(rollbacks);
    return std::pow(options_.rollback_lr_factor(), k * n + k * (k + 1) / 2);
  }
  snapshot_ring& ring() { return ring_; }
  /// The step number of the initial weights (start(): the first step's - 1).
  int64_t initial_step() const { return initial_step_; }

 private:
  struct bad_batch_record {
    int64_t first_step = 0;
    int64_t times = 0;
    bool quarantined = false;
    std::vector<finding> findings;
  };

  decision table_decision(const step_record& r) const;
  policy by_cause(const step_record& r) const;
  bool scale_overflow(const step_event& e, std::optional<cause> c) const;
  bool spiked_three_times(const step_event& e);
  bool far_above_best(double loss) const;
  bool early_runaway(double loss) const;
  void remember_finite(const step_event& e);
  std::string too_many_bad() const;
  bad_batch_record* bad_batch_of(const step_record& r);
  int64_t measured_interval();
  void count_step(bool bad);

  training_host& host_;
  const loss_scaler& scaler_;
  const guard_options& options_;
  rank_agreement* ranks_;
  snapshot_ring ring_;
  int64_t skipped_ = 0;
  int64_t rollbacks_ = 0;
  int64_t bad_in_a_row_ = 0;
  double lr_factor_ = 1.0;
  // Whether each of the last max_bad_window steps was bad (max_bad_fraction).
  std::deque<bool> recent_bad_;
  static constexpr int64_t max_bad_window = 100, max_bad_min_steps = 20;
  // auto: the batches that went bad (by fingerprint), how often, and the
  // findings of the first time.
  std::unordered_map<uint64_t, bad_batch_record> bad_batches_;
  int64_t spiking_ = 0;  // finite steps in a row whose loss spiked by spike_rollback_z
  bool runaway_ = false;  // the last finite step ran away (running_away)
  // The run's best window: the lowest median of calm_window consecutive
  // losses (grad norms) of steps taken, and the first loss (a runaway loss
  // is above both).
  static constexpr int64_t calm_window = 5;
  static constexpr double calm_factor = 10, calm_norm_factor = 100, runaway_factor = 1e3;
  // A forecast this close to the range's end is acted on (sentinel::forecast).
  static constexpr int64_t forecast_steps = 3;
  double best_loss_ = HUGE_VAL, best_norm_ = HUGE_VAL, first_loss_ = HUGE_VAL;
  // Rollbacks since the run was last calm enough for a snapshot: each cuts
  // the LR more than the one before.
  int64_t cuts_in_a_row_ = 0;
  // Finite steps since the start or the last rollback: a snapshot waits
  // until the spike windows hold enough of them to tell a calm step.
  int64_t steps_observed_ = 0;
  std::deque<double> losses_, grad_norms_;
  // Snapshots: the steps to the next (snapshot_every, or up to 10 times
  // more when one costs more than its budget; 0: to be measured), the step
  // of the last, what it cost and how long a step takes. The budget: 0.2%
  // of the steps' time; a snapshot under 1 ms (a small model's) always fits.
  int64_t snapshot_interval_ = 0;
  int64_t last_snapshot_ = 0;
  bool started_ = false;
  int64_t initial_step_ = 0;
  bool snapshot_pending_ = false;
  double snapshot_s_ = 0;
  double step_s_ = 0;
  std::optional<int64_t> restored_step_;  // the snapshot the last rollback restored
  bool refusal_warned_ = false;  // a snapshot over the memory budget was warned about
  static constexpr double snapshot_budget = 0.002, snapshot_always_s = 1e-3;
};

}  // namespace nanguard::detail
