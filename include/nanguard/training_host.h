// training_host.h — what the guard needs from the training loop it guards,
// as one small interface: the guard's step (its policies, replay, rollback,
// bundle and event log) is written once, and each front end says how its
// model and optimizer do these few things. `module_host` is the LibTorch
// one (a torch::nn::Module and a torch::optim::Optimizer); the Python
// module implements it for an nn.Module and a torch.optim optimizer.
//
//   nanguard::module_host host(*model, optimizer);
//   nanguard::snapshot_ring ring(host, /*capacity=*/2);
//   ring.take(0);
//   host.set_lrs({1e-3});
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <stdexcept>
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

/// Thrown by a step function or a host to stop training now (the Python
/// module throws it for KeyboardInterrupt and SystemExit): the guard lets it
/// through where it notes other errors and goes on (a replay that throws
/// gives the verdict "replay failed").
/// NOTE: the one nanguard error that is not a c10::Error, on purpose: it is
/// no failed check but the user stopping the run, and must never be taken
/// for one. What handles a c10::Error (LibTorch's wrappers, which rename it
/// RuntimeError for Python; nanguard's readers and replays, which turn one
/// into a note or a ValueError) would swallow or rename it. Each `catch
/// (const std::exception&)` in nanguard that goes on catches this type
/// first and rethrows it.
class interrupted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Parameters by name, in the model's order.
using named_tensors = std::vector<std::pair<std::string, at::Tensor>>;

/// A copy of a model's and its optimizer's state (training_host::save);
/// each host extends it with what it keeps.
struct saved_state {
  virtual ~saved_state() = default;
  /// The parameters as they were (what a rollback's diff compares).
  named_tensors parameters;
};

/// The model and optimizer of one training loop, as the guard drives them.
class training_host {
 public:
  virtual ~training_host() = default;
  /// The trainable parameters, by name.
  virtual named_tensors named_parameters() = 0;
  /// Sets every gradient to undefined (None).
  virtual void zero_grad() = 0;
  /// Steps the optimizer on the gradients.
  virtual void optimizer_step() = 0;
  /// Each param group's learning rate.
  virtual std::vector<double> lrs() = 0;
  /// Sets each param group's learning rate (as many as lrs() gives).
  virtual void set_lrs(const std::vector<double>& lrs) = 0;
  /// A copy of the parameters, buffers and optimizer state.
  virtual std::shared_ptr<const saved_state> save() = 0;
  /// The bytes of memory the copy save() would make now holds: what a
  /// snapshot costs, known before it is taken (snapshot_ring's memory
  /// budget). The default counts the parameters only; a host whose saves
  /// hold more (buffers, optimizer state) says so.
  virtual int64_t state_bytes();
  /// Puts a copy `save()` made back in place (parameters keep their
  /// identity). The learning rates are the caller's to keep or set.
  virtual void restore(const saved_state& state) = 0;
  /// Called after each backward the guard runs or checks, before it reads
  /// the gradients. A host whose model reduces its gradients in backward
  /// (distributed_options::backward) makes them readable here (FSDP2: each
  /// local shard's gradient) and, in a traced run, returns whether this
  /// rank's own gradients were finite before that collective: a NaN/Inf it
  /// received from another rank does not make this rank its origin. (Only
  /// in a traced run: watching them costs a pass over every gradient, and on
  /// a healthy step the reduced gradients being finite says that every
  /// rank's own were.) The default: true.
  virtual bool backward_done() { return true; }
  /// Readies the model for a traced run (a replay, or a step under
  /// trace_every_step) and returns what undoes it: opens its module scopes
  /// (scope.h) so that findings name modules, and runs a compiled model
  /// eagerly so that the tracer sees every op. The default does nothing:
  /// LibTorch modules are named by their parameters.
  virtual std::function<void()> begin_traced_run() { return {}; }
  /// For a compiled model (torch.compile) whose eager replay stayed finite:
  /// runs `step_finite` (the step again from its RNG state: whether its
  /// loss and gradients stayed finite) under each stage of the compiler in
  /// turn, as PyTorch's minifier bisects (eager, aot_eager, the model's
  /// backend), and says which stage made the NaN/Inf first and where (the
  /// fused kernel, when the backend shows it). Empty when the model is not
  /// compiled (the default) or when no stage makes it again.
  virtual std::string bisect_compiled(const std::function<bool()>& step_finite) {
    (void)step_finite;
    return {};
  }
};

/// The host of a LibTorch module and optimizer. Its saves deep-copy the
/// optimizer's state for the optimizers LibTorch ships (Adam, AdamW, SGD,
/// RMSprop, Adagrad) and serialize any other; what lives on a GPU is copied
/// into pinned host memory (asynchronously, on the current stream) and back.
///
/// NOTE: both must outlive the host.
class module_host : public training_host {
 public:
  module_host(torch::nn::Module& module, torch::optim::Optimizer& optimizer);

  named_tensors named_parameters() override;
  void zero_grad() override;
  void optimizer_step() override;
  std::vector<double> lrs() override;
  void set_lrs(const std::vector<double>& lrs) override;
  std::shared_ptr<const saved_state> save() override;
  int64_t state_bytes() override;
  void restore(const saved_state& state) override;

  /// The module.
  torch::nn::Module& module() { return module_; }

 private:
  torch::nn::Module& module_;
  torch::optim::Optimizer& optimizer_;
};

/// Multiplies every learning rate of `host` by `factor`.
void scale_lrs(training_host& host, double factor);

}  // namespace nanguard
