// step_replay.h — how the guard names the op of a bad step: the step run
// again from the same RNG state under the tracer (a compiled model's eager
// replay that stays finite is bisected through the compiler's stages), or,
// with trace_every_step, the live trace of every step.
//
//   step_replay replay(host, sentinel, scaler, options, batch_names);
//   const bool own_bad = replay.replay(record);   // record.event: findings, verdict
#pragma once

#include "guard/step_record.h"

#include "nanguard/loss_scaler.h"
#include "nanguard/sentinel.h"
#include "nanguard/tracer.h"
#include "nanguard/training_host.h"

#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace nanguard::detail {

/// The host's traced run (its module scopes, a compiled model run eagerly),
/// begun while it lives (a replay that throws ends it too). TorchScript runs
/// unoptimised meanwhile: after its first runs the graph executor runs a
/// scripted model's differentiable subgraphs as units (a copy_ out of a
/// DifferentiableGraph), not the ops the model's code names, which its first
/// run, and a trace of it, show.
class traced_run {
 public:
  explicit traced_run(training_host& host);
  ~traced_run();
  traced_run(const traced_run&) = delete;
  traced_run& operator=(const traced_run&) = delete;

 private:
  std::function<void()> end_;
  bool script_optimized_;
};

/// What one more run of a step gave (step_replay::rerun).
struct rerun_outcome {
  bool finite = false;  ///< every loss and gradient finite
  /// The mean of the micro-batches' losses; NaN when one was not finite.
  double loss = std::numeric_limits<double>::quiet_NaN();
  /// The gradients' global norm, unscaled (NaN when one is not finite).
  double grad_norm = std::numeric_limits<double>::quiet_NaN();
  /// The sentinel's pass over them (empty when a loss was not finite).
  grad_report report;
  /// Traced and not finite: the tracer's first finding, as one line ("" if none).
  std::string first_finding;
};

/// Runs a bad step again under the tracer, or traces every step live.
class step_replay {
 public:
  /// REQUIRES: every argument outlives the step_replay; `batch_names` is
  /// read at each step (guard::set_batch_names changes it).
  step_replay(training_host& host, const sentinel& sentinel, loss_scaler& scaler, const guard_options& options,
              const std::vector<std::string>& batch_names);

  /// trace_every_step: starts the tracer of step `step`'s forward and
  /// backward (`batches`: none when a framework runs the step). Else nothing.
  void start_live_trace(const micro_batches& batches, int64_t step);
  /// Ends the live trace: its findings become `e`'s.
  void finish_live_trace(step_event& e);
  /// Drops the live trace of a step that will not be checked.
  void drop_live_trace();

  /// Runs the step of `r` again from its RNG state, under the tracer; fills
  /// the event's findings and verdict, and `r.bad_batch` with the
  /// micro-batch in which the tracer found the first. Leaves gradients
  /// zeroed and the RNG where the original step left it. Returns whether
  /// this rank's own loss or gradients (before a backward collective) were
  /// not finite in it.
  bool replay(step_record& r);

  /// Runs the step of `r` once more from its RNG state on `batches` (its own,
  /// or a remedy's) with the loss scaled by `scale`, under the tracer when
  /// `traced` (whose findings name modules inside a traced_run, which also
  /// runs a compiled model eagerly; outside one, the model runs as it
  /// trains). Leaves the gradients for the caller (an optimizer step may
  /// follow) and the RNG where it was. Throws what the step throws.
  rerun_outcome rerun(const step_record& r, const micro_batches& batches, double scale, bool traced);

 private:
  void name_tensors(tracer& t, const micro_batches& batches, int64_t step) const;
  bool forward_backward(const std::vector<at::Tensor>& batch, const step_fn& fn, size_t n, tracer& t);
  void bisect_compiled(step_record& r);

  training_host& host_;
  const sentinel& sentinel_;
  loss_scaler& scaler_;
  const guard_options& options_;
  const std::vector<std::string>& batch_names_;
  // trace_every_step: the tracer of the step's forward and backward, and the
  // host's traced run it attributes ops by.
  std::optional<tracer> live_;
  std::optional<traced_run> live_run_;
};

}  // namespace nanguard::detail
