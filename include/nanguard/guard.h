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
#include <nanguard/fault_injection.h>
#include <nanguard/guard_options.h>
#include <nanguard/run_summary.h>
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
  using micro_batches = nanguard::micro_batches;
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
  /// `number`: the step's number as the framework knows it (Lightning's
  /// global_step), in its event, findings and warnings from now on (the
  /// initial weights are the number before the first step's); none: one
  /// more than the last step's (the first step is 1).
  /// Throws c10::Error when `number` is negative or not above the last step's.
  void begin_step(std::optional<int64_t> number = std::nullopt);
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
  /// The dataset index of each row (along dim 0) of batch tensor `t` of the
  /// next step (step(), step_accumulated(), or the check() of the step
  /// begin_step() started): a finding that reads `t` names the dataset
  /// index of its bad row (finding::dataset_index). Used by that step only.
  ///
  ///   g.set_sample_indices(x, {1024, 17, 5});   // x holds dataset rows 1024, 17 and 5
  ///
  /// Throws c10::Error when `indices` has not one entry per row of `t`.
  void set_sample_indices(const at::Tensor& t, std::vector<int64_t> indices);
  /// Plants the fault `spec` (fault_injection.h) in this guard's steps, in
  /// place of one planted before: the tests and campaigns of what the guard
  /// detects and how it classifies it. The event of the step it fires in
  /// says so in its note ("injected: nan written into ..."). The
  /// environment variable NANGUARD_INJECT (fault_spec_from_string's text)
  /// plants one when the guard is made.
  /// Throws c10::Error when the op is unknown, the rank is not in the
  /// guard's group, or the step has passed.
  void inject(const fault_spec& spec);
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
