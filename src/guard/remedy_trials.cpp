#include "guard/remedy_trials.h"

#include "nanguard/clip.h"
#include "nanguard/policy.h"

#include "detail/dtype_limits.h"
#include "detail/median.h"
#include "detail/nonfinite_rows.h"

#include <ATen/ATen.h>
#include <c10/core/ScalarType.h>

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <cmath>
#include <limits>
#include <set>

namespace nanguard::detail {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The most steps an LR-cut check trains from the snapshot (the steps it took
// the run to diverge from there, up to this many).
constexpr int64_t kMostLrCutSteps = 20;
// A loss this many times above its start has run away (recovery's calm factor).
constexpr double kRunawayFactor = 10;
// A remedy's loss this many times the run's recent median has not saved the
// step (recovery's runaway factor).
constexpr double kFarAboveRecent = 1e3;
// The most LR cuts tried: what the next 1, 2, 3, 4 rollbacks would cut together.
constexpr int64_t kMostLrCuts = 4;
// An LR check's detail when the batch fails from the calm weights too.
constexpr const char* kNotTheLr = "the batch is not finite from the calm weights either: not the LR";

// The op a remedy rewrites: a backward finding's forward op (the backward
// follows the rewritten forward).
std::string target_op(const finding& f) {
  return f.direction == direction::backward && !f.forward_op.empty() ? f.forward_op : f.op;
}

// The dtype the op ran in: its first floating input's (a backward's gradient's).
at::ScalarType dtype_of(const finding& f) {
  const std::vector<tensor_record>& records = f.inputs.empty() ? f.outputs : f.inputs;
  for (const tensor_record& r : records)
    for (const at::ScalarType t : {at::kHalf, at::kBFloat16, at::kFloat, at::kDouble})
      if (r.dtype == c10::toString(t)) return t;
  return at::kFloat;
}

bool low_precision(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// `value` (the remedy's advice, e.g. the 1e-12 of clamp_min(1e-12)), raised
// to what the dtype holds as a normal number (float16 flushes 1e-12 to 0).
double at_least_normal(double value, at::ScalarType t) { return std::max(value, smallest_normal(t)); }

// A gap below 1 of `value`, or the one the dtype resolves (1 - 1e-6 is 1 in float16).
double gap_below_one(double value, at::ScalarType t) { return std::max(value, epsilon(t)); }

const std::set<std::string> kLogs = {"aten::log", "aten::log2", "aten::log10"};
const std::set<std::string> kRoots = {"aten::sqrt", "aten::rsqrt", "aten::pow"};
const std::set<std::string> kInverseTrig = {"aten::acos", "aten::asin", "aten::atanh"};
const std::set<std::string> kDivisions = {"aten::div", "aten::div_", "aten::reciprocal"};
const std::set<std::string> kSoftmaxes = {"aten::softmax", "aten::_softmax"};

// The op rewrite of `f`'s cause (the diagnosis's advice, mechanically), if
// its op has one. The constants are docs/diagnosis.md's remedies'.
std::optional<op_rewrite> rewrite_for(const finding& f) {
  const std::string op = target_op(f);
  const at::ScalarType t = dtype_of(f);
  switch (f.diagnosis.cause) {
    case cause::log_of_nonpositive:
      if (kLogs.count(op)) return op_rewrite::clamp_input(op, at_least_normal(1e-12, t), kInf);
      if (op == "aten::log1p") return op_rewrite::clamp_input(op, -1 + gap_below_one(1e-6, t), kInf);
      break;
    case cause::sqrt_at_zero:
      if (kRoots.count(op)) return op_rewrite::clamp_input(op, at_least_normal(1e-12, t), kInf);
      break;
    case cause::inverse_trig_at_bound:
      if (kInverseTrig.count(op)) return op_rewrite::clamp_input(op, -1 + gap_below_one(1e-6, t), 1 - gap_below_one(1e-6, t));
      break;
    case cause::division_by_zero:
      if (kDivisions.count(op)) return op_rewrite::denominator_eps(op == "aten::div_" ? "aten::div" : op, 1e-5);
      if (op == "aten::rsqrt") return op_rewrite::clamp_input(op, at_least_normal(1e-12, t), kInf);
      break;
    case cause::fully_masked_softmax:
      if (kSoftmaxes.count(op)) return op_rewrite::safe_softmax(op);
      break;
    case cause::precision_range:
    case cause::overflow:
      if (low_precision(t)) return op_rewrite::float32(op, t);
      if (op == "aten::exp") return op_rewrite::clamp_input(op, -kInf, std::min(80.0, std::log(largest_finite(t)) - 1));
      break;
    default: break;
  }
  return std::nullopt;
}

// Whether the check of an op-level remedy is worth making: the cause has one.
bool has_op_remedy(cause c) {
  switch (c) {
    case cause::log_of_nonpositive:
    case cause::sqrt_at_zero:
    case cause::inverse_trig_at_bound:
    case cause::division_by_zero:
    case cause::fully_masked_softmax:
    case cause::precision_range:
    case cause::overflow: return true;
    default: return false;
  }
}

remedy_check not_checkable(remedy_kind kind, std::string applied, std::string why) {
  remedy_check c;
  c.remedy = kind;
  c.applied = std::move(applied);
  c.result = check_result::not_checkable;
  c.detail = std::move(why);
  return c;
}

// Restores the host's state (parameters, optimizer, LRs) as it was when it was made.
class saved_host {
 public:
  explicit saved_host(training_host& host) : host_(host), state_(host.save()), lrs_(host.lrs()) {}
  ~saved_host() {
    host_.restore(*state_);
    host_.set_lrs(lrs_);
    host_.zero_grad();
  }
  saved_host(const saved_host&) = delete;
  saved_host& operator=(const saved_host&) = delete;
  const std::vector<double>& lrs() const { return lrs_; }

 private:
  training_host& host_;
  std::shared_ptr<const saved_state> state_;
  std::vector<double> lrs_;
};

// The micro-batches without the rows (along dim 0) that hold a NaN/Inf in
// any floating tensor; `dropped` counts them. A micro-batch left with no
// row is left out.
micro_batches without_nonfinite_rows(const micro_batches& batches, int64_t& dropped, int64_t& rows) {
  micro_batches out;
  for (const std::vector<at::Tensor>& batch : batches) {
    int64_t n = -1;
    at::Tensor bad;
    for (const at::Tensor& t : batch) {
      if (!t.defined() || !t.is_floating_point() || t.dim() == 0 || (n >= 0 && t.size(0) != n)) continue;
      n = t.size(0);
      const at::Tensor row_bad = nonfinite_rows(t);
      bad = bad.defined() ? bad.logical_or(row_bad) : row_bad;
    }
    if (!bad.defined()) {
      out.push_back(batch);
      continue;
    }
    rows += n;
    const at::Tensor keep = at::logical_not(bad).nonzero().squeeze(1);
    dropped += n - keep.numel();
    if (keep.numel() == 0) continue;
    std::vector<at::Tensor> kept;
    for (const at::Tensor& t : batch)
      kept.push_back(t.defined() && t.dim() > 0 && t.size(0) == n ? t.index_select(0, keep.to(t.device())) : t);
    out.push_back(std::move(kept));
  }
  return out;
}

}  // namespace

remedy_trials::remedy_trials(training_host& host, step_replay& replay, recovery& recovery, const sentinel& sentinel,
                             const loss_scaler& scaler, const guard_options& options)
    : host_(host), replay_(replay), recovery_(recovery), sentinel_(sentinel), scaler_(scaler), options_(options) {}

// `c`, a replay that came out finite, unless its loss runs away from the
// run's recent losses (recovery's rule): a remedy that makes the loss 1e9
// has not saved the step.
remedy_check remedy_trials::unless_running_away(remedy_check c) const {
  const std::deque<double>& recent = recovery_.losses();
  if (recent.empty() || c.remedy == remedy_kind::lr_cut) return c;  // the LR check judges its own run
  const double typical = median({recent.begin(), recent.end()});
  if (!(std::abs(c.loss) > kFarAboveRecent * std::max(std::abs(typical), 1e-12))) return c;
  c.result = check_result::still_nonfinite;
  c.detail = fmt::format("finite, but its loss {:.6g} runs away from the run's recent {:.6g}", c.loss, typical);
  return c;
}

remedy_trials::outcome remedy_trials::check(const finding& f, const step_record& r, const op_patch* patch_in_force) {
  outcome out;
  checks_of(f, r, patch_in_force, out);
  return out;
}

// `trial()`, the check of a remedy of `kind`, in the host's traced run (the
// tracer's module names; a compiled model runs eagerly, where a rewrite
// reaches its ops); when it throws (the step itself, or a remedy its code
// refuses), a not-checkable check that says why.
template <typename Trial>
remedy_check remedy_trials::guarded(remedy_kind kind, Trial trial) {
  try {
    const traced_run run(host_);
    return trial();
  } catch (const interrupted&) {
    throw;  // Ctrl-C: the user stops the run
  } catch (const std::exception& ex) {
    host_.zero_grad();
    return not_checkable(kind, "", "the replay failed: " + message_of(ex));
  }
}

void remedy_trials::checks_of(const finding& f, const step_record& r, const op_patch* patch_in_force, outcome& out) {
  // The checks stop at the first finite one: its rewrite, if any, is the verified one.
  const auto tried = [&](remedy_check c, std::optional<op_rewrite> rewrite = std::nullopt) {
    if (c.result == check_result::finite) c = unless_running_away(std::move(c));
    const bool finite = c.result == check_result::finite;
    if (finite) out.verified_rewrite = std::move(rewrite);
    out.checks.push_back(std::move(c));
    return finite;
  };
  const auto lr_cut = [&] { return guarded(remedy_kind::lr_cut, [&] { return try_lr_cut(r); }); };
  const cause c = f.diagnosis.cause;
  if (c == cause::bad_data) {
    tried(guarded(remedy_kind::skip_rows, [&] { return try_without_rows(r); }));
    return;
  }
  if (c == cause::divergence) {
    tried(lr_cut());
    return;
  }
  const bool scaled = scaler_.enabled() && scaler_.get_scale() > 1;
  if ((c == cause::precision_range || c == cause::overflow) && scaled && f.direction == direction::backward &&
      tried(guarded(remedy_kind::loss_scale_cut, [&] { return try_loss_scales(r); })))
    return;
  const std::optional<op_rewrite> rewrite = rewrite_for(f);
  if (rewrite &&
      tried(guarded(rewrite->kind, [&] { return try_rewrite(*rewrite, r, patch_in_force); }), rewrite))
    return;
  // An overflow of values that grew over training: the LR that grew them.
  if (c == cause::overflow) {
    tried(lr_cut());
    return;
  }
  if (rewrite) return;
  tried(not_checkable(remedy_kind::none, "",
                      has_op_remedy(c) ? fmt::format("no rewrite of {} for {}", target_op(f), to_string(c))
                                       : fmt::format("no mechanical remedy for {}", to_string(c))));
}

// The step again with `rewrite` in force.
remedy_check remedy_trials::try_rewrite(const op_rewrite& rewrite, const step_record& r,
                                        const op_patch* patch_in_force) {
  remedy_check c;
  c.remedy = rewrite.kind;
  c.applied = rewrite.description();
  if (patch_in_force)
    return not_checkable(c.remedy, c.applied,
                         "auto_fix keeps " + patch_in_force->rewrite().description() + "; one patch at a time");
  const op_patch patch(rewrite);
  rerun_outcome o;
  {
    const op_patch::scope on;
    o = replay_.rerun(r, *r.batches, scaler_.get_scale(), /*traced=*/true);
  }
  host_.zero_grad();
  if (patch.calls_rewritten() == 0)
    return not_checkable(c.remedy, c.applied, "the replay ran no " + rewrite.op + " the rewrite changes");
  return replayed(std::move(c), o);
}

// The step again at lower loss scales: half, 1/16, 1/256 of it, then 1.
remedy_check remedy_trials::try_loss_scales(const step_record& r) {
  remedy_check c;
  c.remedy = remedy_kind::loss_scale_cut;
  const double scale = scaler_.get_scale();
  for (const double lower : {scale / 2, scale / 16, scale / 256, 1.0}) {
    if (lower >= scale || lower < 1) continue;
    const rerun_outcome o = replay_.rerun(r, *r.batches, lower, /*traced=*/false);
    host_.zero_grad();
    c.applied = fmt::format("loss scale {:g} -> {:g}", scale, lower);
    if (o.finite) return replayed(std::move(c), o);
  }
  c.applied = fmt::format("loss scale {:g} -> 1", scale);
  c.result = check_result::still_nonfinite;
  c.detail = "the gradients are not finite at any scale down to 1";
  return c;
}

// The step again without the batch's non-finite rows.
remedy_check remedy_trials::try_without_rows(const step_record& r) {
  int64_t dropped = 0, rows = 0;
  const micro_batches kept = without_nonfinite_rows(*r.batches, dropped, rows);
  const std::string applied = fmt::format("the batch without its {} non-finite row{} (of {})", dropped,
                                          dropped == 1 ? "" : "s", rows);
  if (dropped == 0)
    return not_checkable(remedy_kind::skip_rows, "the batch without its non-finite rows",
                         "no row of the batch holds a NaN/Inf (its bad values are finite)");
  if (kept.empty()) return not_checkable(remedy_kind::skip_rows, applied, "no row is left");
  remedy_check c;
  c.remedy = remedy_kind::skip_rows;
  c.applied = applied;
  const rerun_outcome o = replay_.rerun(r, kept, scaler_.get_scale(), /*traced=*/true);
  host_.zero_grad();
  return replayed(std::move(c), o);
}

// From the last calm snapshot, the steps it took the run to diverge, each
// on the failing batch, at the LR the next rollback would set, then the next
// few (each cuts more): the first LR at which the loss stays finite and does
// not run away is the one verified.
remedy_check remedy_trials::try_lr_cut(const step_record& r) {
  const std::string what = "a cut LR from the last calm snapshot";
  snapshot_ring& ring = recovery_.ring();
  if (ring.empty())
    return not_checkable(remedy_kind::lr_cut, what,
                         recovery_.rolls_back() ? "no calm snapshot was taken yet"
                                                : fmt::format("policy {} keeps no snapshot (auto and rollback do)",
                                                              to_string(options_.policy())));
  if (!r.step_optimizer) return not_checkable(remedy_kind::lr_cut, what, "a framework steps the optimizer");
  remedy_check c;
  for (int64_t rollbacks = 1; rollbacks <= kMostLrCuts; ++rollbacks) {
    c = train_from_snapshot(r, recovery_.lr_cut_after(rollbacks));
    if (c.result == check_result::finite || c.detail == kNotTheLr) break;
  }
  return c;
}

// The failing batch trained on from the newest snapshot at the LR times
// `cut`, as many steps as the run took from there to fail (at most
// kMostLrCutSteps); the model and optimizer are restored after.
remedy_check remedy_trials::train_from_snapshot(const step_record& r, double cut) {
  snapshot_ring& ring = recovery_.ring();
  const int64_t steps = std::clamp<int64_t>(r.event.step - ring.newest_step(), 1, kMostLrCutSteps);
  remedy_check c;
  c.remedy = remedy_kind::lr_cut;
  c.applied = fmt::format("lr x{:.3g} for {} step{} on this batch from step {}'s weights", cut, steps,
                          steps == 1 ? "" : "s", ring.newest_step());
  const saved_host saved(host_);
  ring.restore();
  std::vector<double> lrs = saved.lrs();
  for (double& lr : lrs) lr *= cut;
  host_.set_lrs(lrs);
  const double scale = scaler_.get_scale();
  rerun_outcome first, o;
  for (int64_t k = 0; k <= steps; ++k) {
    o = replay_.rerun(r, *r.batches, scale, /*traced=*/false);
    if (k == 0) first = o;
    if (!o.finite) {
      c.result = check_result::still_nonfinite;
      c.detail = k == 0 ? kNotTheLr : fmt::format("not finite after {} step{}", k, k == 1 ? "" : "s");
      return c;
    }
    if (k == steps) break;
    sentinel_.apply_factor_((1.0 / scale) * clip_coefficient(o.grad_norm, options_.max_norm()));
    host_.optimizer_step();
  }
  if (o.loss > first.loss * kRunawayFactor) {
    c.result = check_result::still_nonfinite;
    c.loss = o.loss;
    c.detail = fmt::format("the loss runs away: {:.6g} -> {:.6g}", first.loss, o.loss);
    return c;
  }
  return replayed(std::move(c), o);
}

// `c` with the outcome of its replay.
remedy_check remedy_trials::replayed(remedy_check c, const rerun_outcome& o) const {
  c.loss = o.loss;
  c.result = o.finite ? check_result::finite : check_result::still_nonfinite;
  if (!o.finite)
    c.detail = !o.first_finding.empty() ? o.first_finding
               : std::isfinite(o.loss)  ? "the gradients are not finite"
                                        : "the loss is not finite";
  return c;
}

}  // namespace nanguard::detail
