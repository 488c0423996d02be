// tracer.h — names the first op, forward or backward, that turned finite
// inputs into a NaN or Inf.
//
// A RecordFunction observer checks the floating-point outputs of every ATen
// op (and so of every op inside autograd's backward nodes), and takes a
// census only of what it flags. An output is read (one pass, as fast as
// `has_nonfinite`) unless the ranges of the op's arguments prove it finite:
// the tracer remembers the range of every tensor it has seen until its next
// write, and interval arithmetic bounds what sums, products, matrix
// products, softmaxes, normalisations and optimiser updates make of them.
// While no tracer lives, nothing is observed and nothing is paid.
//
//   nanguard::tracer t(nanguard::tracer_options().throw_on_finding(true));
//   t.name_parameters(*model);          // findings name parameters and modules
//   t.set_step(step);
//   auto loss = model->forward(x).mean();
//   loss.backward();
//   t.throw_if_found();                 // nanguard::nonfinite_error with the finding
//
// On a GPU the outputs are not read when each op ends, which would be a host
// sync per op: their checks are enqueued on the op's stream into a
// `nonfinite_record`, the op's context is kept host-side, and the record is
// read once, when the findings are asked for (see tracer_options::deferred).
//
// NOTE: ATen swallows exceptions thrown inside RecordFunction callbacks, so
// the tracer cannot throw from inside the op. It records the finding, stops
// checking once max_findings are made, and throws at `throw_if_found()`,
// which the caller runs after the step (the guard does).
#pragma once

#include <nanguard/diagnosis.h>  // the tracer diagnoses each finding it makes
#include <nanguard/finding.h>
#include <nanguard/tracer_options.h>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace nanguard {

namespace detail {
struct tracer_state;  // tracer/tracer_state.h: what its RecordFunction callbacks share
}  // namespace detail

/// Observes every op while it lives and reports non-finite outputs.
///
/// One tracer may live per thread (or one with all_threads per process);
/// making a second throws. Not copyable; movable only by pointer.
class tracer {
 public:
  explicit tracer(tracer_options options = {});
  ~tracer();
  tracer(const tracer&) = delete;
  tracer& operator=(const tracer&) = delete;

  /// Names parameters (and through them modules) from `module.named_parameters()`.
  void name_parameters(const torch::nn::Module& module, const std::string& prefix = "");
  /// Names parameters (and through them modules) from (name, parameter) pairs.
  void name_parameters(const std::vector<std::pair<std::string, at::Tensor>>& named);
  /// Names one tensor of the data, e.g. the input batch ("batch"): a finding
  /// whose non-finite input it is names it as the culprit (bad_data); once
  /// the data is named, an unnamed input is none of it (constant_in_model).
  void name_tensor(const at::Tensor& tensor, const std::string& name);
  /// The step findings are tagged with; also forgets the previous step's ops
  /// and which tensors it saw finite. Call it every step when the program
  /// refills tensors through data_ptr() (a data loader's reused buffer):
  /// within a step, an in-place op on a tensor seen finite since its last
  /// recorded write does not scan its old values again. A tensor written
  /// behind LibTorch's back within a step needs `mark_written`.
  void set_step(int64_t step);
  /// What this thread's tracing knows of `tensors` now (the range their
  /// values lie in) outlasts set_step() and this tracer, until a recorded
  /// write changes them. For an optimizer's state, which only the
  /// optimizer's own in-place ops write: call it after each optimizer step
  /// (`nanguard.trace` does for torch.optim's optimizers), and the next
  /// step's update does not read the state again to learn its old values
  /// (27 MB a step for the reference workload's AdamW). Never for a tensor
  /// something writes between steps behind LibTorch's back (through
  /// data_ptr(), or untraced through its .data): such a write would go unseen.
  void keep_known_across_steps(const std::vector<at::Tensor>& tensors);
  /// The same for the state `optimizer` keeps per parameter, when it is one
  /// of LibTorch's (Adam, AdamW, SGD, Adagrad, RMSprop; LBFGS keeps none):
  ///
  ///     optimizer.step();
  ///     tracer.keep_known_across_steps(optimizer);
  void keep_known_across_steps(const torch::optim::Optimizer& optimizer);

  /// The traced model's forward returned `outputs` (its tensors): judges
  /// every chain recorded so far by whether its values reach them. For a
  /// pass with no backward (evaluation, a validation loop, torch.no_grad()),
  /// where nothing else judges: an intended infinity the model absorbs (a
  /// causal mask) is then no finding, one that reaches its outputs is. A
  /// backward pass after it still makes a chain that reaches the loss or a
  /// gradient a finding. `nanguard.trace(model)` calls it after each forward.
  void judge_by_outputs(const std::vector<at::Tensor>& outputs);
  /// False when judge_by_outputs() would change nothing, so that the caller
  /// need not collect the outputs: no chain is recorded that is unjudged or
  /// has not yet reached the loss, a gradient or the outputs, and no check
  /// waits on the deferred path. A healthy pass on the CPU leaves it false;
  /// an absorbed chain (a causal mask's -inf) keeps it true.
  bool awaits_judgement() const;

  /// Findings so far, first first.
  const std::vector<finding>& findings() const;
  /// True when at least one finding was made.
  bool found() const;
  /// Forgets the findings and starts checking again.
  void clear();
  /// Throws nonfinite_error with the first finding, if any and if
  /// throw_on_finding is set.
  void throw_if_found() const;

  /// Stops observing until resumed (the tracer keeps its findings).
  void pause();
  /// Observes again after pause().
  void resume();
  /// True while observing.
  bool active() const;

  /// The options it was made with.
  const tracer_options& options() const;
  /// Its own cost so far: zeros unless the options ask to measure it. The
  /// time excludes what RecordFunction spends before calling it (boxing
  /// each op's inputs and outputs, ~1 us per op).
  tracer_cost cost() const;

 private:
  std::unique_ptr<detail::tracer_state> state_;
};

/// Pauses a tracer for the life of the guard (e.g. around evaluation code).
class tracer_pause {
 public:
  explicit tracer_pause(tracer& t) : tracer_(t), was_active_(t.active()) { tracer_.pause(); }
  ~tracer_pause() {
    if (was_active_) tracer_.resume();
  }
  tracer_pause(const tracer_pause&) = delete;
  tracer_pause& operator=(const tracer_pause&) = delete;

 private:
  tracer& tracer_;
  bool was_active_;
};

/// Tells tracers that `tensor`'s values changed outside a recorded op: a
/// c10d collective (nanguard's distributed helpers call it for theirs), a
/// write through data_ptr(). Bumps its version counter, as an in-place op
/// does, so that no tracer trusts what it knew of the old values.
void mark_written(const at::Tensor& tensor);

}  // namespace nanguard
