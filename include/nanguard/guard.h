// guard.h — what a user puts in a LibTorch training loop to keep it finite.
//
// Every step: the loss is checked before backward; after backward one fused
// pass over the gradients (the sentinel) gives the norms, unscaling and
// clipping ride on it, and spikes are flagged. When anything is not finite
// nothing is stepped: the guard replays the same step (same batch, same
// parameters, same RNG state) under the tracer to name the op that made the
// NaN/Inf, then its policy acts (skip, back off the loss scale, roll back and
// lower the LR, or write a repro bundle and throw). Every step is a line in
// the JSONL event log.
//
//   nanguard::guard g(model, optimizer, nanguard::guard_options()
//                                           .policy(nanguard::policy::rollback)
//                                           .max_norm(1.0)
//                                           .event_log("train.jsonl"));
//   for (auto& [x, y] : batches) {
//     nanguard::step_event e = g.step({x, y}, [&](const std::vector<at::Tensor>& b) {
//       return torch::nn::functional::cross_entropy(model->forward(b[0]), b[1]);
//     });
//     if (e.skipped) std::cerr << "step " << e.step << ": " << nanguard::to_string(e.action) << "\n";
//   }
//   // verbose (the default) says it on stderr too: a line per bad step, a summary at the end.
//
// Distributed (data parallel): give it a `distributed` (distributed.h) and
// every rank averages its gradients, agrees on one decision per step, and
// logs the ranks that saw a NaN/Inf and the finding of the rank that saw it.
//
// NOTE: the step closure must be a function of the batch, the parameters and
// the RNG only (no other hidden state that changes between calls), so that
// a replay repeats it.
#pragma once

#include <nanguard/events.h>
#include <nanguard/loss_scaler.h>
#include <nanguard/policy.h>
#include <nanguard/run_summary.h>
#include <nanguard/schedule.h>
#include <nanguard/sentinel.h>
#include <nanguard/snapshot.h>
#include <nanguard/tracer.h>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
template <typename Contained>
class ModuleHolder;
}  // namespace torch::nn
namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace nanguard {

class distributed;
class training_host;
struct bundle;

/// (name, value) tags of a repro bundle.
using bundle_tag_list = std::vector<std::pair<std::string, std::string>>;

/// Options of a `guard`.
struct guard_options {
  /// The remedy for a non-finite step; auto picks it by the diagnosed cause.
  TORCH_ARG(nanguard::policy, policy) = policy::automatic;
  /// Clip the global grad norm to this (0: no clipping).
  TORCH_ARG(double, max_norm) = 0.0;
  /// Clamp gradient elements to ±clip_value after norm clipping (0: off).
  TORCH_ARG(double, clip_value) = 0.0;
  /// Dynamic loss scaling; disabled by default (enable it for float16).
  TORCH_ARG(loss_scaler_options, scaler) = loss_scaler_options().enabled(false);
  /// Spike detection on the loss and the grad norm.
  TORCH_ARG(spike_options, spikes) = {};
  /// Replay a bad step under the tracer to name the op (and give a verdict).
  TORCH_ARG(bool, replay) = true;
  /// Trace the forward and backward of every step instead: a bad step's
  /// findings come from the step itself, with no replay (and no verdict).
  /// Costs the tracer's overhead on every step (docs/performance.md).
  TORCH_ARG(bool, trace_every_step) = false;
  /// Options of the replay's tracer (and of trace_every_step's). A replay
  /// runs once per bad step, so it also checks inside kernels to name the
  /// op within.
  TORCH_ARG(tracer_options, tracer) = tracer_options().inside_kernels(true);
  /// Each event lists this many of the largest per-parameter grad norms.
  TORCH_ARG(int64_t, log_top_norms) = 5;
  /// JSONL event log path ("" : no log file).
  TORCH_ARG(std::string, event_log) = "";
  /// Truncate the event log at start (false: append).
  TORCH_ARG(bool, truncate_event_log) = true;
  /// Where abort writes repro bundles ("": none).
  TORCH_ARG(std::string, bundle_dir) = "nanguard-bundles";
  /// Tags a bundle carries (meta.json), e.g. {"task", "classify"} for
  /// `nanguard replay`; guard::set_bundle_tags changes them between steps.
  TORCH_ARG(bundle_tag_list, bundle_tags) = {};
  /// The front end the run trains through: a finding's remedy is written
  /// for it (docs/diagnosis.md); nanguard.Guard, its callbacks and
  /// `nanguard train` set theirs.
  TORCH_ARG(nanguard::front_end, front_end) = front_end::cpp;
  /// The file the training data comes from ("": none), named in the remedy
  /// of bad data (`nanguard scan FILE`).
  TORCH_ARG(std::string, data_file) = "";
  /// Save the parameters in the bundle too.
  TORCH_ARG(bool, bundle_parameters) = true;
  /// rollback and auto: snapshot every this many steps (and once at start),
  /// or under auto less often (down to 10 x snapshot_every) when a snapshot
  /// costs more than 0.2% of the steps between two (and more than 1 ms); a
  /// due snapshot waits for a step with finite values and no spike.
  TORCH_ARG(int64_t, snapshot_every) = 10;
  /// rollback and auto: the newest snapshots kept, and as many older ones,
  /// the first of each 10 x snapshot_every steps (snapshot.h).
  TORCH_ARG(int64_t, snapshot_keep) = 2;
  /// rollback and auto: the LR is multiplied by this on every rollback.
  TORCH_ARG(double, rollback_lr_factor) = 0.5;
  /// rollback and auto: false runs the offending batch again after rolling back.
  TORCH_ARG(bool, rollback_skip_batch) = true;
  /// auto: a loss spike of at least this robust z-score (and 10 times the
  /// median loss before) on 3 steps in a row rolls back before the NaN/Inf
  /// comes (0: off).
  TORCH_ARG(double, spike_rollback_z) = 100.0;
  /// Bad steps in a row after which the guard aborts, with a repro bundle,
  /// whatever the policy (0: never).
  TORCH_ARG(int64_t, max_bad_steps) = 20;
  /// The guard aborts, with a repro bundle, when more than this fraction of
  /// the last 100 steps (once there are 20) were bad, whatever the policy
  /// (1: never).
  TORCH_ARG(double, max_bad_fraction) = 0.5;
  /// An LR schedule the guard applies every step (times the rollback factor).
  TORCH_ARG(std::optional<schedule_options>, schedule) = std::nullopt;
  /// Tell the user what the guard does: one line on stderr for each bad
  /// step (its op, cause, what the guard did and the remedy; a repeat of the
  /// same failure in a few words) and, when the guard is destroyed after a
  /// bad step, the run's summary (run_summary.h). Distributed: rank 0 only.
  /// false: silent (the event log and narrator() still have it all).
  TORCH_ARG(bool, verbose) = true;
  /// Distributed: this rank's process group (distributed.h). After backward
  /// the gradients are averaged over the ranks and one consensus all-reduce
  /// per step makes every rank take the same decision (nullptr: one process).
  /// NOTE: the guard's constructor is then a collective too: it checks that
  /// every rank guards as many parameters, and throws naming those that differ.
  TORCH_ARG(std::shared_ptr<nanguard::distributed>, distributed) = nullptr;
};

/// The step closure: batch → scalar loss (forward only; the guard does backward).
using step_fn = std::function<at::Tensor(const std::vector<at::Tensor>& batch)>;

/// Guards the training steps of one model and its optimizer.
///
/// NOTE: single-threaded use; the model and optimizer must outlive the guard.
class guard {
 public:
  /// Guards `model`'s parameters, stepped by `optimizer`. Validates options.
  guard(torch::nn::Module& model, torch::optim::Optimizer& optimizer, guard_options options = {});
  /// Guards the model and optimizer of `host` (training_host.h): how a front
  /// end other than LibTorch's modules plugs in. Validates options.
  explicit guard(std::shared_ptr<training_host> host, guard_options options = {});
  /// The same for a module holder (`torch::nn::Linear`, a TORCH_MODULE type).
  template <typename Impl>
  guard(torch::nn::ModuleHolder<Impl>& model, torch::optim::Optimizer& optimizer, guard_options options = {})
      : guard(*model.ptr(), optimizer, std::move(options)) {}
  ~guard();
  guard(const guard&) = delete;
  guard& operator=(const guard&) = delete;

  /// Runs one guarded step on `batch`: zero grads, loss = fn(batch), checks,
  /// (scaled) backward, sentinel pass, unscale + clip, optimizer step, or the
  /// policy. Returns the step's event (also written to the log).
  /// Throws nonfinite_error under policy abort (after writing the bundle;
  /// one that cannot be written is a warning and a note in the event), and
  /// c10::Error when the loss scale falls below its minimum.
  step_event step(const std::vector<at::Tensor>& batch, const step_fn& fn);

  /// The micro-batches of one optimizer step.
  using micro_batches = std::vector<std::vector<at::Tensor>>;
  /// Gradient accumulation: one guarded optimizer step over several
  /// micro-batches. `fn` runs on each, its loss divided by their number
  /// before backward; the checks run once, over the accumulated gradients.
  /// The event's loss is the mean of the micro-batches' losses; a replay
  /// runs them again, and an abort's bundle keeps the micro-batch in which
  /// the replay found the first non-finite op (its index is in the note).
  ///
  ///   g.step_accumulated({{x0, y0}, {x1, y1}}, loss_fn);
  ///
  /// Throws c10::Error when `batches` is empty.
  step_event step_accumulated(const micro_batches& batches, const step_fn& fn);

  /// When a framework runs forward, backward and the optimizer step itself:
  /// begin_step() before the step's first forward (counts the step, applies
  /// the schedule, keeps the RNG state a replay starts from), then check().
  void begin_step();
  /// Checks the step begin_step() started, after backward (of every
  /// micro-batch) and before the framework's optimizer step, with unscaled
  /// gradients: the loss check and one sentinel pass; a finite step is
  /// unscaled, clipped and logged, and the framework's optimizer steps. On a
  /// bad step `replay` (forward only, from the batch, as step()'s closure;
  /// none: no replay) is traced from begin_step's RNG state, the policy
  /// acts and the gradients are left undefined, so that the optimizer's
  /// step changes nothing. `batch` is what an abort's bundle keeps.
  /// Throws c10::Error when no step was begun, or when no backward wrote a
  /// gradient since begin_step() and the loss is finite (call backward
  /// first); nonfinite_error under abort.
  step_event check(const at::Tensor& loss, const step_fn& replay = {}, const std::vector<at::Tensor>& batch = {});
  /// Drops the step begin_step() started, when the framework skipped it
  /// (Lightning's training_step returned None for every micro-batch):
  /// nothing is checked or logged, and the step is not counted.
  /// Throws c10::Error when no step was begun.
  void cancel_step();

  /// Runs a repro bundle's step again (what `nanguard replay` does): loads
  /// the bundle's parameters into the model and its RNG states, then `fn`
  /// on its batch and the (scaled) backward under the replay's tracer, as a
  /// bad step's replay. Returns the event: the bundle's step and loss, the
  /// findings, and the verdict (reproduced, not reproduced, or replay
  /// failed, the note saying why). Nothing is stepped or counted.
  ///
  ///   nanguard::step_event e = g.replay(nanguard::read_bundle("bundles/step-000012"), loss_fn);
  ///
  /// Throws c10::Error when a bundled parameter is not the model's or has
  /// another shape.
  step_event replay(const bundle& b, const step_fn& fn);

  /// The tags of the bundles written from now on (what the next batch is,
  /// e.g. {"csv_lines", "12,13"}), instead of the options' bundle_tags.
  void set_bundle_tags(bundle_tag_list tags);
  /// The names of the batch tensors from now on, in findings and their
  /// diagnosis: names[i] names the i-th tensor of each micro-batch ("x",
  /// "labels"); an unnamed one ("" or past the end) is "batch[i]".
  ///
  ///   g.set_batch_names({"x", "y"});   // a NaN in y: culprit "y", bad_data
  void set_batch_names(std::vector<std::string> names);
  /// The event of the last step (after an abort's nonfinite_error: its
  /// bundle, notes and findings). Throws c10::Error before the first step.
  const step_event& last_event() const;

  /// Steps run so far.
  int64_t steps() const;
  /// Steps the optimizer did not take.
  int64_t skipped() const;
  /// Rollbacks so far.
  int64_t rollbacks() const;
  /// The product of the rollback LR factors so far.
  double lr_factor() const;
  /// The loss scaler.
  loss_scaler& scaler();
  /// The sentinel.
  nanguard::sentinel& sentinel();
  /// The snapshot ring (empty unless the policy is rollback or auto).
  snapshot_ring& snapshots();
  /// The options it was made with.
  const guard_options& options() const;
  /// What the run did so far: the last step's warning line and the summary
  /// (what verbose prints).
  const run_narrator& narrator() const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace nanguard
