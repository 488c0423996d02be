// distributed.h — data-parallel training under the guard, on torch.distributed's
// c10d (ProcessGroupGloo here; any c10d ProcessGroup works).
//
// Every rank runs the same guard. Each step one small all-reduce (the
// consensus) carries every rank's non-finite flag and squared grad norm, so
// every rank takes the same decision (step / skip / backoff / rollback /
// abort) at the same step, the loss scale stays identical, and the event
// names the ranks that saw the NaN/Inf. The replay runs on those ranks; its
// finding, tagged with the rank, is broadcast into every rank's log.
//
//   // Started by `nanguard launch -n 4 -- ./train` (RANK, WORLD_SIZE,
//   // MASTER_ADDR, MASTER_PORT in the environment, as torchrun sets them).
//   auto pg = nanguard::init_process_group_from_env(
//       nanguard::process_group_options().timeout(30));
//   auto dist = std::make_shared<nanguard::distributed>(pg);
//   nanguard::guard g(model, optimizer, nanguard::guard_options()
//                                           .distributed(dist)
//                                           .max_norm(1.0));
//   for (auto& [x, y] : my_shard_of_the_batches)
//     g.step({x, y}, loss_fn);  // backward, gradient all-reduce, consensus
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace nanguard {

/// How a process joins its process group.
struct process_group_options {
  /// Seconds a collective (and the rendezvous) may wait for the other ranks
  /// before it throws: a dead rank makes the others fail, not hang.
  TORCH_ARG(double, timeout) = 60.0;
  /// The address Gloo binds to ("": MASTER_ADDR, or 127.0.0.1 for a file store).
  TORCH_ARG(std::string, hostname) = "";
};

/// Joins the process group described by the environment, as torchrun sets
/// it: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT. Rank 0 serves a TCPStore
/// on MASTER_ADDR:MASTER_PORT; returns a ProcessGroupGloo.
///
///   auto pg = nanguard::init_process_group_from_env();
///
/// Throws c10::Error naming the missing or malformed variable, or when the
/// other ranks do not arrive within the timeout.
c10::intrusive_ptr<c10d::ProcessGroup> init_process_group_from_env(process_group_options options = {});

/// Joins a process group of `world_size` ranks that meet in a FileStore at
/// `store_path` (a file on a shared file system; every rank passes the same).
///
///   auto pg = nanguard::init_process_group("/tmp/run1.store", rank, 2);
c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const std::string& store_path, int64_t rank,
                                                          int64_t world_size, process_group_options options = {});

/// The collective a model's own backward reduces the gradients with, when a
/// wrapper does it (PyTorch's DistributedDataParallel, FSDP2's fully_shard).
///
/// With one, every rank runs backward even on a non-finite loss (the
/// collective must run everywhere), the rank a NaN/Inf came from is told by
/// the training host (its own gradients before the collective), and a replay
/// runs on every rank (the model's collectives again) while the ranks the
/// NaN/Inf came from trace it.
enum class backward_collective {
  none,            ///< the model's backward is local: the guard averages (or not, see average_gradients)
  all_reduce,      ///< DistributedDataParallel: every rank holds the averaged gradients
  reduce_scatter,  ///< FSDP2: every rank holds its shard of the averaged gradients
};

/// Every backward_collective, in declaration order.
inline constexpr backward_collective all_backward_collectives[] = {
    backward_collective::none, backward_collective::all_reduce, backward_collective::reduce_scatter};
/// "none", "all-reduce" or "reduce-scatter".
const char* to_string(backward_collective c);
/// The backward_collective whose to_string is `name`, e.g. "all-reduce".
/// Throws c10::Error listing the names for another.
backward_collective backward_collective_from_string(const std::string& name);

/// Options of `distributed`.
struct distributed_options {
  /// Average the gradients over the ranks after backward (data parallel).
  /// false: each rank's gradients are its own shard; the global grad norm is
  /// then the root of the sum of the ranks' squared norms. Ignored when the
  /// model's backward reduces them itself (`backward`).
  TORCH_ARG(bool, average_gradients) = true;
  /// The collective the model's own backward reduces the gradients with
  /// (none: the guard's business).
  TORCH_ARG(backward_collective, backward) = backward_collective::none;
  /// Gradients are all-reduced in flat buckets of about this many MB.
  TORCH_ARG(double, bucket_mb) = 25.0;
  /// Every this many steps, after averaging, compare a checksum of the
  /// gradients across ranks and name the ranks that differ (0: never).
  /// Ignored, as average_gradients is, under a backward collective.
  TORCH_ARG(int64_t, check_every) = 0;
};

/// A collective that failed because another rank died or did not answer
/// within the process group's timeout; its message names that rank (Python:
/// RuntimeError).
class rank_failure : public c10::Error {
 public:
  using c10::Error::Error;
};

/// What the ranks agreed on in one consensus all-reduce.
struct consensus {
  std::vector<int64_t> nonfinite_ranks;  ///< ranks whose loss or gradients were not finite
  double grad_norm = 0;                  ///< the finite ranks' grad norms combined: sqrt of the sum of their squares
  double loss_sum = 0;                   ///< sum over ranks of the losses (finite ranks)
  /// True when every rank was finite.
  bool finite() const { return nonfinite_ranks.empty(); }
};

/// One rank's view of a process group, as the guard uses it.
///
///   nanguard::distributed d(pg);
///   d.average_gradients_(params);                       // data parallel
///   nanguard::consensus c = d.agree(!finite, grad_norm, loss_value);  // one small all-reduce
///   if (!c.finite()) std::cerr << "rank " << c.nonfinite_ranks[0] << " saw NaN\n";
///
/// NOTE: every method is a collective: every rank must call it, in the same order.
class distributed {
 public:
  /// Wraps `process_group`. Validates options.
  explicit distributed(c10::intrusive_ptr<c10d::ProcessGroup> process_group, distributed_options options = {});
  ~distributed();
  distributed(const distributed&) = delete;
  distributed& operator=(const distributed&) = delete;

  /// This process's rank.
  int64_t rank() const;
  /// The number of ranks.
  int64_t world_size() const;
  /// The options it was made with.
  const distributed_options& options() const;
  /// The process group.
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const;

  /// The consensus: ONE all-reduce of a float64 vector [flag per rank,
  /// grad_norm², (grad_norm·2^-600)², loss] with SUM. Slot r holds only rank
  /// r's flag, so the sum is the gathered flags (which ranks were bad) and
  /// the other slots are sums; the scaled squares give the combined norm
  /// where the plain ones overflow (a float64 norm beyond 1e154). `step`
  /// names the step in the error a failed all-reduce raises.
  consensus agree(bool nonfinite, double grad_norm, double loss, int64_t step = -1);

  /// Data-parallel averaging: every gradient of `parameters` (undefined ones
  /// become zeros) is all-reduced in flat buckets of about bucket_mb and
  /// divided by the world size. Then calls the after-average hook with `step`.
  void average_gradients_(const std::vector<at::Tensor>& parameters, int64_t step = -1);

  /// The gradient-consistency check: gathers a checksum of the gradients of
  /// `parameters` from every rank; returns the ranks whose checksum differs
  /// from the majority (every rank when there is no majority); empty when all
  /// agree. After averaging, a differing rank points at silent data corruption.
  std::vector<int64_t> check_consistency(const std::vector<at::Tensor>& parameters);

  /// Checks that every rank guards the same model: as many parameters as
  /// rank 0 and, with `same_sizes`, as many elements (ranks that each hold a
  /// shard of the model pass false). Throws c10::Error naming the ranks that
  /// differ, and what they hold.
  void check_same_parameters(const std::vector<at::Tensor>& parameters, bool same_sizes);

  /// Broadcasts `text` from rank `root`; every rank returns root's text.
  std::string broadcast(const std::string& text, int64_t root);

  /// Waits until every rank gets here.
  void barrier();

  /// The other ranks that have exited (on this host: each rank records its
  /// host and process id in the process group's store when it makes its
  /// `distributed`), as "rank 1 (host h, pid 42) has exited"; empty when none is known to.
  /// Called after a collective failed: when no rank of this host has exited
  /// yet, it looks again for up to a second, as a killed rank's connections
  /// close before its process shows as exited.
  std::string exited_ranks() const;

  /// Throws rank_failure for `what` (e.g. "the consensus all-reduce of step
  /// 7"), which failed with `cause`: names the ranks that exited, or else
  /// those that did not answer, and says where to look.
  [[noreturn]] void raise_failure(const std::string& what, const std::exception& cause) const;

  /// A hook run after every average_gradients_ with the step and the
  /// parameters (fault injection in tests: corrupt a gradient on one rank).
  void on_averaged(std::function<void(int64_t step, const std::vector<at::Tensor>& parameters)> hook);

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

/// A 64-bit checksum of the bytes of `tensors` (in order): equal checksums on
/// two ranks mean bit-identical tensors (up to hash collisions). A tensor on
/// a GPU is read through a copy to the host.
uint64_t checksum(const std::vector<at::Tensor>& tensors);

}  // namespace nanguard
