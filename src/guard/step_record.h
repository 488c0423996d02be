// step_record.h — one guarded step as the guard's stages pass it along:
// its micro-batches and closure, the RNG state it began from, what the
// sentinel measured, and the event it ends as. Per-step state lives here;
// what outlasts a step lives in the guard and its collaborators (recovery,
// step_replay, rank_agreement).
#pragma once

#include "nanguard/distributed.h"
#include "nanguard/events.h"
#include "nanguard/guard_options.h"
#include "nanguard/sentinel.h"

#include "detail/generator_states.h"

#include <c10/util/Exception.h>

#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace nanguard::detail {

/// One guarded step, from begin to its event.
struct step_record {
  /// The micro-batches of the step (one for guard::check): the caller's, by
  /// reference, as the step function gets them (a front end may find a
  /// micro-batch by its address); null for a step begun and not yet checked.
  const micro_batches* batches = nullptr;
  /// The loss of a micro-batch; empty when a framework runs the step and
  /// gave no replay closure (nothing can run it again).
  step_fn fn;
  /// The RNG state the step began from: a replay starts there again.
  generator_states rng_before;
  /// The sentinel's pass over the step's gradients.
  grad_report report;
  /// Whether this rank's loss and gradients were finite (before any consensus).
  bool locally_finite = false;
  /// The micro-batch a bundle keeps: the first bad one.
  size_t bad_batch = 0;
  /// Whether the guard steps the optimizer (false: a framework does).
  bool step_optimizer = true;
  /// Whether the step's batch was quarantined (auto): skipped, not replayed.
  bool quarantined = false;
  /// A finite step whose loss runs away (recovery::running_away): not taken.
  bool runaway = false;
  /// guard::set_sample_indices: batch tensors and their rows' dataset indices.
  std::vector<std::pair<at::Tensor, std::vector<int64_t>>> sample_indices;
  /// The largest value the loss's dtype holds (the forecast's limit).
  double loss_limit = std::numeric_limits<float>::max();
  /// What happened, as the event log records it.
  step_event event;

  /// The micro-batch a bundle and a diagnosis read.
  const std::vector<at::Tensor>& bad_micro_batch() const { return batches->at(bad_batch); }
};

/// Adds `note` to `notes`, "; " between two.
inline void add_note(std::string& notes, const std::string& note) {
  if (!notes.empty()) notes += "; ";
  notes += note;
}

/// The one line an error says: a c10::Error's message without its backtrace.
inline std::string message_of(const std::exception& ex) {
  const auto* error = dynamic_cast<const c10::Error*>(&ex);
  return error ? error->what_without_backtrace() : ex.what();
}

/// How findings name the i-th tensor of a batch: its name in `names`, else
/// its position ("batch[2]").
inline std::string batch_name(const std::vector<std::string>& names, size_t i) {
  return i < names.size() && !names[i].empty() ? names[i] : "batch[" + std::to_string(i) + "]";
}

/// A micro-batch's share of the step's loss: the mean over `n` micro-batches
/// is the gradient of the whole batch (one micro-batch: the loss itself).
inline at::Tensor share_of(const at::Tensor& loss, size_t n) { return n == 1 ? loss : loss / double(n); }

/// Each parameter's gradient and its version: a backward sets or adds to them.
using gradient_marks = std::vector<std::pair<const void*, int64_t>>;

/// The gradient marks of `parameters` now.
gradient_marks mark_gradients(const std::vector<at::Tensor>& parameters);

/// Whether a backward wrote a gradient of `parameters` since `before`
/// (mark_gradients then): one defined now that is another tensor, or the
/// same at a later version.
bool gradients_written_since(const std::vector<at::Tensor>& parameters, const gradient_marks& before);

/// The loss `fn` gives for `batch`; refuses a step function that ran
/// backward itself on `parameters` (following torch's "retain_graph=True"
/// advice would then add every gradient twice).
at::Tensor loss_of(const step_fn& fn, const std::vector<at::Tensor>& batch, const std::vector<at::Tensor>& parameters);

/// The `k` largest of `norms` with their `names`, largest first (NaN first of all).
std::vector<std::pair<std::string, double>> top_norms(const std::vector<std::string>& names,
                                                      const std::vector<double>& norms, int64_t k);

/// The collective the model's own backward runs (DDP, FSDP2), or none.
inline backward_collective collective_of(const guard_options& options) {
  return options.distributed() ? options.distributed()->options().backward() : backward_collective::none;
}

}  // namespace nanguard::detail
