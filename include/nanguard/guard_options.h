// guard_options.h — what a `guard` is made with (guard.h): its policy,
// clipping, loss scaling, snapshots, replay, logs and limits, in the
// LibTorch options style, and the step closure it runs. Apart from guard.h
// so that the guard's parts (src/guard/) read them without the guard.
//
//   nanguard::guard_options o = nanguard::guard_options().policy(nanguard::policy::rollback).max_norm(1.0);
#pragma once

#include <nanguard/diagnosis.h>
#include <nanguard/loss_scaler.h>
#include <nanguard/policy.h>
#include <nanguard/schedule.h>
#include <nanguard/sentinel.h>
#include <nanguard/tracer_options.h>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

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
  /// Options of the replay's tracer (and of trace_every_step's). It names
  /// the ops the user's code called, as nanguard.trace does (not the ops a
  /// kernel runs inside itself: one answer from every front end), and
  /// records the sources of forward ops, so that a backward finding names
  /// the user's line.
  TORCH_ARG(tracer_options, tracer) = tracer_options().record_sources(true);
  /// After a replay names the op of a bad step, try the diagnosis's remedy
  /// on the step (inside further replays only: an op rewrite, a lower loss
  /// scale, the batch without its NaN/Inf rows, a cut LR from the last calm
  /// snapshot) and record on the finding whether it kept the step finite
  /// (finding::remedy_checks, remedy_check.h). Costs one to four replays per
  /// bad step that is replayed; an LR cut, up to 4 x 21 forward/backward
  /// from the snapshot. Under the policies that keep no snapshots (skip,
  /// backoff, abort) the guard keeps the initial weights for that check (one
  /// copy of the model and optimizer state, within snapshot_memory_mb).
  /// Not in a distributed run (a replay on one rank would run the model's
  /// collectives alone).
  TORCH_ARG(bool, verify_remedies) = true;
  /// Keep the first verified op rewrite (a safe softmax, an eps on a zero
  /// denominator, a clamp before log/sqrt/acos/exp, an op in float32) in
  /// force for the rest of the run: every later step runs with it, every
  /// warning and the summary say so. The model's code is not changed: make
  /// the remedy a change to it. NOTE: every op then passes through the
  /// rewrite's dispatcher hook (a few microseconds each); eager ops only (a
  /// compiled model's graph is not rewritten). REQUIRES: verify_remedies.
  TORCH_ARG(bool, auto_fix) = false;
  /// A finite step whose loss or grad norm spiked runs again from the same
  /// state (untraced; one process), and the two runs' signatures
  /// (step_signature.h) are compared: when they differ a third run decides,
  /// and a transient fault's step is taken as the agreeing runs computed it
  /// (event fault "transient"). Costs one or two forward/backward per spike.
  TORCH_ARG(bool, replay_spikes) = true;
  /// Every this many steps (0: never), a finite step runs again and the two
  /// runs' signatures are compared, as for a spike: corruption too small to
  /// spike, at the cost of one forward/backward per audited step.
  TORCH_ARG(int64_t, audit_every) = 0;
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
  /// auto and rollback: the megabytes (1e6 bytes) of memory the
  /// snapshots may hold together; the oldest go first to make room, and a
  /// snapshot larger than the whole budget is not taken (a warning says so,
  /// and a rollback without a snapshot skips). 0: a quarter of this
  /// machine's memory.
  TORCH_ARG(double, snapshot_memory_mb) = 0;
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

/// The micro-batches of one optimizer step (guard::step_accumulated).
using micro_batches = std::vector<std::vector<at::Tensor>>;

}  // namespace nanguard
