// script_model.h — what `nanguard train` and `nanguard replay` share: loading
// a TorchScript model as a usage error, a torch::nn::Module view of its
// parameters (for the guard, the tracer and snapshots), running it on a
// batch, and the loss of a task.
#pragma once

#include "commands.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/nn/module.h>

#include <memory>
#include <string>

namespace nanguard::cli {

/// Loads `path`; a usage_error when it is missing, a directory or not a
/// TorchScript file.
///
///   torch::jit::Module m = load_script_model("model.pt");
torch::jit::Module load_script_model(const std::string& path);

/// A torch::nn::Module tree mirroring `m`'s submodules and holding the very
/// same parameter and buffer tensors, so the guard, the tracer and snapshots
/// see dotted names like `encoder.layers.0.weight` and train `m` in place.
///
///   auto params = mirror_parameters(m);
///   torch::optim::AdamW opt(params->parameters(), 1e-3);
std::shared_ptr<torch::nn::Module> mirror_parameters(const torch::jit::Module& m);

/// The model's output on `x`: a tensor, or the first element of a tuple.
/// A usage_error when it returns anything else.
at::Tensor forward_tensor(torch::jit::Module& m, const at::Tensor& x);

/// A usage_error unless `out`, the model's output, can make a loss to train
/// on: a floating-point tensor that depends on trainable parameters (not,
/// e.g., argmax classes or the output of a model without parameters).
void require_trainable(const at::Tensor& out);

/// The loss of `task` ("classify": cross entropy of [rows, classes] logits
/// and int64 labels; "regress": MSE of [rows] or [rows, 1] outputs).
/// A usage_error when the output's shape does not fit the task or it is not
/// trainable (require_trainable).
at::Tensor task_loss(const at::Tensor& out, const at::Tensor& y, const std::string& task);

/// The first line worth showing of an exception thrown by TorchScript code
/// (its "RuntimeError: ..." line, without the interpreter's traceback).
std::string one_line_error(const std::string& what);

/// Makes TorchScript run autograd per op while it lives, so the tracer sees
/// `SqrtBackward0` and not one fused `DifferentiableGraphBackward`.
struct per_op_autograd {
  per_op_autograd();
  ~per_op_autograd();
  per_op_autograd(const per_op_autograd&) = delete;
  per_op_autograd& operator=(const per_op_autograd&) = delete;
};

}  // namespace nanguard::cli
