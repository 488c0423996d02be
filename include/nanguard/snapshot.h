// snapshot.h — an in-memory ring of parameter, buffer and optimizer state,
// for rolling a diverged run back, and a diff that ranks the parameters by
// how far they moved since the last good snapshot (which layer diverged).
//
//   nanguard::snapshot_ring ring(*model, optimizer, /*capacity=*/2, /*far_every=*/100);
//   if (step % 10 == 0) ring.take(step);   // keeps the 2 newest, and 2 older ones 100 steps apart
//   // ... training diverges ...
//   for (auto& c : ring.diff()) std::cout << c.name << " " << c.relative << "\n";
//   int64_t back_to = ring.restore();   // parameters and optimizer state
#pragma once

#include <nanguard/training_host.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}  // namespace torch::nn
namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace nanguard {

/// How far one parameter moved between a snapshot and now.
struct param_change {
  std::string name;          ///< parameter name
  double relative = 0;       ///< |now - then| / (|then| + 1e-12); Inf when now is not finite
  double absolute = 0;       ///< |now - then| (L2)
  double norm_then = 0;      ///< |then| (L2)
  double norm_now = 0;       ///< |now| (L2); NaN/Inf when not finite
  bool finite = true;        ///< whether the parameter is finite now
};

/// A ring of the last `capacity` snapshots of a model and its optimizer and,
/// with `far_every` > 0, `capacity` older ones besides: the first snapshot
/// taken in each window of `far_every` steps is kept until `capacity` newer
/// such ones replace it, so a divergence that outlasts the recent snapshots
/// can go further back than them without going back to the start.
///
/// NOTE: copies live in host memory (one copy of parameters, buffers and
/// optimizer state per snapshot: at most 2 x capacity of them, and no more
/// bytes than the memory budget when one is set); a module_host copies a
/// GPU's tensors into pinned host memory, asynchronously on the current stream.
class snapshot_ring {
 public:
  /// Watches what `host` saves (training_host.h). REQUIRES: capacity >= 1,
  /// far_every >= 0; the host outlives the ring.
  explicit snapshot_ring(training_host& host, int64_t capacity = 2, int64_t far_every = 0);
  /// Watches `module` (parameters and buffers) and `optimizer` (its state).
  /// REQUIRES: capacity >= 1, far_every >= 0; both outlive the ring.
  snapshot_ring(torch::nn::Module& module, torch::optim::Optimizer& optimizer, int64_t capacity = 2,
                int64_t far_every = 0);
  ~snapshot_ring();

  /// Copies the current state, tagged with `step` (larger than the newest's);
  /// drops the snapshots neither among the `capacity` newest nor among the
  /// `capacity` newest far ones. With a memory budget, the oldest go first
  /// to make room for it (before it is copied: the ring never holds more);
  /// a snapshot larger than the whole budget is not taken: returns false,
  /// and refusal() says why.
  bool take(int64_t step);
  /// Bounds the bytes the snapshots hold together (training_host::
  /// state_bytes each); 0: no bound. Drops the oldest that do not fit now.
  void set_memory_budget(int64_t bytes);
  /// The bytes the snapshots hold now.
  int64_t held_bytes() const;
  /// Why the last take() kept nothing ("" when it kept its snapshot):
  /// "a snapshot takes 84 GB, over the memory budget of 32 GB".
  const std::string& refusal() const { return refusal_; }
  /// Restores the newest snapshot in place (parameters keep their identity;
  /// the learning rates stay as they are); returns its step. Throws
  /// c10::Error when the ring is empty.
  int64_t restore();
  /// Drops the newest snapshot (e.g. when it led to a second divergence).
  void drop_newest();
  /// Newest snapshot vs the current parameters, largest relative change first.
  std::vector<param_change> diff() const;

  /// Snapshots held.
  int64_t size() const { return int64_t(ring_.size()); }
  /// True when no snapshot is held.
  bool empty() const { return ring_.empty(); }
  /// Step of the newest snapshot; -1 when empty.
  int64_t newest_step() const;
  /// The steps of the snapshots held, oldest first.
  std::vector<int64_t> steps() const;

 private:
  struct snapshot {
    int64_t step;
    std::shared_ptr<const saved_state> state;
    bool far;  // the first taken in its window of far_every steps
    int64_t bytes;  // training_host::state_bytes() when it was taken
  };
  void prune();
  void fit(int64_t more);

  std::unique_ptr<training_host> own_host_;  // the module_host of the Module constructor
  training_host& host_;
  int64_t capacity_;
  int64_t far_every_;
  int64_t memory_budget_ = 0;  // bytes; 0: no bound
  std::string refusal_;
  std::deque<snapshot> ring_;  // oldest first
};

}  // namespace nanguard
