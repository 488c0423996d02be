// optimizer_state.h — the tensors a LibTorch optimizer keeps per parameter:
// what the tracer keeps known across steps, and what a snapshot of them
// weighs (training_host::state_bytes).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace nanguard::detail {

/// The state tensors of `optimizer` for the optimizers LibTorch ships (Adam,
/// AdamW, SGD, Adagrad, RMSprop; some may be undefined); none for LBFGS,
/// whose state keeps none per parameter, or an optimizer of the program's
/// own, unknown here.
std::vector<at::Tensor> optimizer_state_tensors(const torch::optim::Optimizer& optimizer);

}  // namespace nanguard::detail
