#include "guard/recovery.h"

#include "guard/rank_agreement.h"

#include "detail/median.h"

#include <c10/util/hash.h>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string_view>

#include <unistd.h>

namespace nanguard::detail {

namespace {

// A batch's fingerprint: the shapes, dtypes and bytes of its tensors (a
// CUDA tensor is copied to the CPU for it: only bad steps read it). None
// for a batch with no tensor.
std::optional<uint64_t> fingerprint(const micro_batches& batches) {
  size_t h = 0;
  bool any = false;
  for (const auto& batch : batches)
    for (const at::Tensor& t : batch) {
      if (!t.defined()) continue;
      any = true;
      const at::Tensor c = t.detach().cpu().contiguous();
      h = c10::hash_combine(h, static_cast<size_t>(c.scalar_type()));
      for (int64_t d : c.sizes()) h = c10::hash_combine(h, static_cast<size_t>(d));
      if (c.layout() == at::kStrided)
        h = c10::hash_combine(h, std::hash<std::string_view>{}(std::string_view(
                                     static_cast<const char*>(c.data_ptr()), c.nbytes())));
    }
  if (!any) return std::nullopt;
  return h;
}

// "moved most since the snapshot: fc.weight (x3.2) fc.bias (by 0.031 from 0)": the
// first 3 changes, each relative to the parameter's norm then, or absolute
// where that norm is ~0 (a zero-initialised bias: any move is a ratio of 1e10),
// listed after the others.
std::string moved_most(std::vector<param_change> changes) {
  std::stable_partition(changes.begin(), changes.end(),
                        [](const param_change& c) { return !c.finite || c.norm_then > 1e-6; });
  std::string moved = "moved most since the snapshot:";
  for (size_t i = 0; i < changes.size() && i < 3; ++i) {
    const param_change& c = changes[i];
    moved += " " + c.name;
    if (!c.finite) moved += " (now non-finite)";
    else if (c.norm_then > 1e-6) moved += fmt::format(" (x{:.3g})", c.relative);
    else moved += fmt::format(" (by {:.3g} from {:.3g})", c.absolute, c.norm_then);
  }
  return moved;
}

// The cause of the first finding of `e` (none without one).
std::optional<cause> first_cause(const step_event& e) {
  return e.findings.empty() ? std::nullopt : std::optional(e.findings.front().diagnosis.cause);
}

// The snapshots' memory budget in bytes: snapshot_memory_mb, or a quarter
// of this machine's memory.
int64_t memory_budget(const guard_options& options) {
  if (options.snapshot_memory_mb() > 0) return static_cast<int64_t>(options.snapshot_memory_mb() * 1e6);
  return static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGE_SIZE) / 4;
}

}  // namespace

recovery::recovery(training_host& host, const loss_scaler& scaler, const guard_options& options,
                   rank_agreement* ranks)
    : host_(host), scaler_(scaler), options_(options), ranks_(ranks),
      ring_(host, options.snapshot_keep(), 10 * options.snapshot_every()) {
  ring_.set_memory_budget(memory_budget(options));
}

bool recovery::rolls_back() const {
  return options_.policy() == policy::rollback || options_.policy() == policy::automatic;
}

// ---- what the steps were

void recovery::observe_finite(step_event& e) {
  ++steps_observed_;
  const bool spiked = spiked_three_times(e);
  const bool leaving = e.forecast && e.forecast->steps_left <= forecast_steps;
  const bool early = early_runaway(e.loss);
  runaway_ =
      rolls_back() && options_.spike_rollback_z() > 0 && (spiked || leaving || early || far_above_best(e.loss));
  if (!runaway_) return remember_finite(e);
  e.reason = spiked ? fmt::format("loss diverging: a spike of z >= {:g} on 3 steps in a row (loss {:.6g})",
                                  options_.spike_rollback_z(), e.loss)
             : leaving ? (e.forecast->series == "loss" ? "loss diverging: " : "grad norm diverging: ") +
                             to_string(*e.forecast)
             : early   ? fmt::format("loss diverging from the start: {:.6g} is over {:g} times the first loss ({:.6g})",
                                     e.loss, calm_factor, first_loss_)
                       : fmt::format("loss diverging: {:.6g} is over {:g} times the run's best ({:.6g})", e.loss,
                                     runaway_factor, best_loss_);
}

// Whether `loss`, in the first steps from the start or a rollback (before
// a calm window), is over calm_factor times the first loss: an LR far too
// high throws a model out of its initial basin in a step or two (AdamW at
// 100 times its stable LR: a transformer's loss 0.73 -> 11 at step 2), and
// it may land on a finite plateau from which no NaN ever comes.
bool recovery::early_runaway(double loss) const {
  return steps_observed_ <= calm_window && first_loss_ > 0 && std::isfinite(first_loss_) &&
         loss > calm_factor * first_loss_;
}

// auto: whether `e` is the third step in a row whose loss spiked by
// spike_rollback_z. A converged loss has so small a spread that a rise
// within noise scores a high z: a spike must also reach 10 times the
// median of the steps before.
bool recovery::spiked_three_times(const step_event& e) {
  const bool watching = options_.policy() == policy::automatic && options_.spike_rollback_z() > 0;
  const bool spiked = watching && std::any_of(e.spikes.begin(), e.spikes.end(), [&](const spike& s) {
    return s.series == "loss" && s.z >= options_.spike_rollback_z() &&
           s.value > 10 * median({losses_.begin(), losses_.end()});
  });
  spiking_ = spiked ? spiking_ + 1 : 0;
  return spiking_ >= 3;
}

// Whether `loss` is orders of magnitude above where the run has been: its
// best window and its first loss (a converged loss of 1e-6 that rises to
// 1e-3 is noise, not a divergence). Losses that may be negative are not
// judged so.
bool recovery::far_above_best(double loss) const {
  return best_loss_ > 0 && std::isfinite(best_loss_) && loss > runaway_factor * best_loss_ && loss > first_loss_;
}

// The windows a diagnosis reads, and the run's best one.
void recovery::remember_finite(const step_event& e) {
  if (first_loss_ == HUGE_VAL) first_loss_ = e.loss;
  losses_.push_back(e.loss);
  grad_norms_.push_back(e.grad_norm);
  if (int64_t(losses_.size()) > options_.spikes().window()) {
    losses_.pop_front();
    grad_norms_.pop_front();
  }
  const auto last = [](const std::deque<double>& d) {
    const size_t n = std::min<size_t>(d.size(), calm_window);
    return median({d.end() - static_cast<std::ptrdiff_t>(n), d.end()});
  };
  best_loss_ = std::min(best_loss_, last(losses_));
  best_norm_ = std::min(best_norm_, last(grad_norms_));
}

bool recovery::calm(const step_event& e) const {
  const auto within = [](double x, double best, double factor) { return !std::isfinite(best) || x <= factor * best; };
  return e.spikes.empty() && within(e.loss, best_loss_, calm_factor) &&
         within(e.grad_norm, best_norm_, calm_norm_factor);
}

void recovery::count_taken() {
  bad_in_a_row_ = 0;
  count_step(false);
}

void recovery::count_not_taken() {
  ++skipped_;
  ++bad_in_a_row_;
  count_step(true);
}

// max_bad_fraction's window: whether this step was bad.
void recovery::count_step(bool bad) {
  recent_bad_.push_back(bad);
  if (int64_t(recent_bad_.size()) > max_bad_window) recent_bad_.pop_front();
}

// auto and rollback in one process: the record of a bad step's batch (none
// when the step has no batch; distributed, each rank's batch is its own, and
// the ranks must decide alike).
recovery::bad_batch_record* recovery::bad_batch_of(const step_record& r) {
  if (!rolls_back() || options_.distributed()) return nullptr;
  const std::optional<uint64_t> id = fingerprint(*r.batches);
  return id ? &bad_batches_[*id] : nullptr;
}

bool recovery::quarantined(step_record& r) {
  const bad_batch_record* b = bad_batch_of(r);
  if (!b || !b->quarantined) return false;
  r.event.findings = b->findings;
  add_note(r.event.note, fmt::format("quarantined batch (bad at step {} first, {} times now): not replayed",
                                     b->first_step, b->times + 1));
  return true;
}

void recovery::remember_bad_batch(step_record& r) {
  bad_batch_record* b = bad_batch_of(r);
  if (!b) return;
  step_event& e = r.event;
  const std::optional<cause> c = first_cause(e);
  if (c == cause::divergence || c == cause::overflow || c == cause::precision_range || scale_overflow(e, c)) return;
  if (b->times++ == 0) {
    b->first_step = e.step;
    b->findings = e.findings;
  }
  // Under rollback only bad data: the user chose to roll back whatever else went wrong.
  const bool twice = options_.policy() == policy::automatic && b->times >= 2;
  if (!b->quarantined && (twice || c == cause::bad_data)) {
    b->quarantined = true;
    add_note(e.note, fmt::format("batch quarantined (bad at step {}{})", b->first_step,
                                 b->times >= 2 ? fmt::format(" and {}", e.step) : std::string()));
  }
}

// ---- the decision

decision recovery::decide(const step_record& r) const {
  const std::string too_many = too_many_bad();
  if (!too_many.empty()) return {policy::abort, too_many};
  const decision d = table_decision(r);
  if (d.policy == policy::rollback && ring_.empty())
    return {policy::skip, "no snapshot to roll back to: " + ring_.refusal()};
  return d;
}

// The decision table's row for `r` (docs/guard.md).
decision recovery::table_decision(const step_record& r) const {
  if (r.runaway) return {policy::rollback, ""};
  if (options_.policy() == policy::automatic) return {by_cause(r), ""};
  // A rollback for bad data keeps the LR: the data is at fault, not the LR
  // (and once quarantined, the batch is skipped: the weights are fine).
  const bool data = r.quarantined || first_cause(r.event) == cause::bad_data;
  if (options_.policy() == policy::rollback && data) return {r.quarantined ? policy::skip : policy::rollback, "", false};
  return {options_.policy(), ""};
}

// Why the run is stopped: max_bad_steps bad steps in a row, or more than
// max_bad_fraction of the recent ones ("" : neither).
std::string recovery::too_many_bad() const {
  if (options_.max_bad_steps() > 0 && bad_in_a_row_ >= options_.max_bad_steps())
    return fmt::format("max_bad_steps={}: {} bad step{} in a row", options_.max_bad_steps(), bad_in_a_row_,
                       bad_in_a_row_ == 1 ? "" : "s");
  const auto bad = std::count(recent_bad_.begin(), recent_bad_.end(), true);
  const auto n = static_cast<int64_t>(recent_bad_.size());
  if (n >= max_bad_min_steps && double(bad) > options_.max_bad_fraction() * double(n))
    return fmt::format("max_bad_fraction={:g}: {} of the last {} steps were bad", options_.max_bad_fraction(), bad, n);
  return "";
}

// Whether the loss scale made bad step `e` (first cause `c`): a finite loss
// whose scaled gradients overflowed, with no cause or a range one.
bool recovery::scale_overflow(const step_event& e, std::optional<cause> c) const {
  return scaler_.enabled() && std::isfinite(e.loss) && (!c || c == cause::precision_range || c == cause::overflow);
}

// auto: the action for the diagnosed cause (docs/guard.md's decision table).
policy recovery::by_cause(const step_record& r) const {
  const std::optional<cause> c = first_cause(r.event);
  if (r.quarantined || c == cause::bad_data) return policy::skip;  // the data's fault: the model is fine
  if (scale_overflow(r.event, c)) return policy::backoff;
  if (c == cause::divergence || c == cause::overflow) return policy::rollback;
  if (c == cause::precision_range) return scaler_.enabled() ? policy::backoff : policy::skip;
  // Skipping does not help when the run itself keeps going bad.
  return bad_in_a_row_ >= 3 ? policy::rollback : policy::skip;
}

// ---- acting

// A run that is already diverging but still finite is not worth returning to.
void recovery::snapshot_if_due(const step_event& e, double step_seconds) {
  step_s_ = step_s_ == 0 ? step_seconds : 0.9 * step_s_ + 0.1 * step_seconds;
  if (e.step - last_snapshot_ < options_.snapshot_every()) return;
  if (snapshot_interval_ == 0) snapshot_interval_ = measured_interval();
  snapshot_pending_ = snapshot_pending_ || e.step - last_snapshot_ >= snapshot_interval_;
  const bool judged = options_.policy() != policy::automatic || steps_observed_ > options_.spikes().min_samples();
  if (snapshot_pending_ && judged && calm(e)) snapshot(e.step);
}

void recovery::start(int64_t first_step, bool keep_weights) {
  if (started_) return;
  started_ = true;
  initial_step_ = last_snapshot_ = first_step - 1;
  if (keep_weights) snapshot(initial_step_);
}

void recovery::snapshot(int64_t step) {
  const auto start = std::chrono::steady_clock::now();
  if (!ring_.take(step) && !refusal_warned_) {
    refusal_warned_ = true;
    TORCH_WARN("nanguard::guard: step ", step, ": no snapshot taken: ", ring_.refusal(),
               " (guard_options::snapshot_memory_mb; Python snapshot_memory_mb=): a rollback restores the newest "
               "snapshot that fit, or without one skips the step; raise the budget, or keep fewer "
               "(snapshot_keep)");
  }
  snapshot_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  last_snapshot_ = step;
  snapshot_interval_ = 0;
  snapshot_pending_ = false;
  cuts_in_a_row_ = 0;  // calm again: the next rollback cuts from the start
}

// The steps from the last snapshot to the next: snapshot_every, or under
// auto as many as keep the last one's cost within budget against the
// steps' time, up to 10 x snapshot_every (the recent snapshots stay
// recent). Distributed: rank 0's, so that every rank snapshots the same steps.
int64_t recovery::measured_interval() {
  const bool budgeted = options_.policy() == policy::automatic && snapshot_s_ >= snapshot_always_s;
  const double within_budget = budgeted ? std::ceil(snapshot_s_ / (snapshot_budget * std::max(step_s_, 1e-9))) : 0;
  const double most = 10.0 * double(options_.snapshot_every());
  const int64_t interval =
      std::max<int64_t>(options_.snapshot_every(), static_cast<int64_t>(std::min(within_budget, most)));
  return ranks_ ? ranks_->rank0s(interval) : interval;
}

double recovery::roll_back(step_event& e, bool cut_lr) {
  add_note(e.note, moved_most(ring_.diff()));  // the diverged layers
  // Diverging again from the snapshot just restored (no newer one since):
  // it was taken on the way up; go one further back when there is one.
  if (ring_.newest_step() == restored_step_ && ring_.size() > 1) ring_.drop_newest();
  restored_step_ = e.rollback_to = ring_.restore();
  // Each rollback before the run is calm again cuts more: a run that
  // diverges from its first step needs its LR cut by 100 in a few rollbacks,
  // not in 7 halvings that each waste the steps up to the next divergence.
  const double factor = cut_lr ? std::pow(options_.rollback_lr_factor(), double(++cuts_in_a_row_)) : 1.0;
  lr_factor_ *= factor;
  ++rollbacks_;
  spiking_ = steps_observed_ = 0;
  runaway_ = false;
  snapshot_pending_ = false;
  return factor;
}

}  // namespace nanguard::detail
