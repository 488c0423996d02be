// bundle.h — the repro bundle: everything needed to look at (and re-run) a
// step that went non-finite, written atomically as one directory:
//
// - meta.json: step, lr, loss scale, policy, verdict, versions, the finding, the note, tags
// - batch.pt: the batch (a list of tensors)
// - rng_state.pt: the CPU generator state at the start of the step
// - cuda_rng_state.pt: each CUDA device's generator state then (a list; empty without a GPU)
// - culprit_inputs.pt: the inputs of the op that produced the NaN/Inf (a list)
// - parameters.pt: the parameters at the start of the step (a dict)
//
// The .pt files are `torch::pickle_save` bytes: Python reads them with
// `torch.load(path)`, C++ with `read_bundle`.
//
//   nanguard::bundle b;  b.step = 120;  b.batch = {x, y};  b.finding = f;
//   std::string dir = nanguard::write_bundle("bundles", b);   // bundles/step-000120
//   nanguard::bundle back = nanguard::read_bundle(dir);
#pragma once

#include <nanguard/events.h>
#include <nanguard/finding.h>
#include <nanguard/policy.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace nanguard {

/// The contents of a repro bundle.
struct bundle {
  int64_t step = -1;               ///< the step that went non-finite
  double lr = 0;                   ///< learning rate of the first param group
  double scale = 1;                ///< loss scale
  double loss = 0;                 ///< the step's loss (NaN/Inf when bad)
  std::optional<nanguard::policy> policy;  ///< the guard's policy (none: not written by a guard)
  nanguard::verdict verdict = verdict::none;  ///< the replay's verdict
  std::optional<nanguard::finding> finding;  ///< the tracer's finding, if any
  /// What the guard noted about the step (step_event::note): of verdict
  /// "compiled only" (no finding: the eager replay ran finite) the
  /// compiler's stage that made the NaN/Inf, its kernel and the remedy.
  std::string note;
  std::vector<at::Tensor> batch;   ///< the step's batch
  at::Tensor rng_state;            ///< CPU generator state at step start (uint8)
  /// Each CUDA device's generator state at step start (uint8; none without a GPU).
  std::vector<at::Tensor> cuda_rng_states;
  std::vector<at::Tensor> culprit_inputs;  ///< inputs of the finding's op
  std::vector<std::pair<std::string, at::Tensor>> parameters;  ///< named parameters
  /// What the writer wants a reader to know, as meta.json's "tags" object,
  /// e.g. {"task", "classify"} for `nanguard replay` (read back sorted by key).
  std::vector<std::pair<std::string, std::string>> tags;
  std::string nanguard_version;    ///< filled by write_bundle
  std::string torch_version;       ///< filled by write_bundle
};

/// Writes `b` as `<parent>/step-<step>` (a suffix -2, -3 ... when taken),
/// atomically: into a temporary directory, then renamed. Returns the path.
/// Throws c10::Error when the directory cannot be written.
std::string write_bundle(const std::string& parent, const bundle& b);

/// Reads a bundle written by write_bundle. Throws c10::Error naming the
/// missing or malformed file.
bundle read_bundle(const std::string& dir);

}  // namespace nanguard
