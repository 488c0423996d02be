#include "detail/optimizer_state.h"

#include <torch/optim.h>

namespace nanguard::detail {

std::vector<at::Tensor> optimizer_state_tensors(const torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> tensors;
  const auto add_moments = [&](const auto& adam) {  // Adam's and AdamW's states, alike but unrelated types
    tensors.insert(tensors.end(), {adam.exp_avg(), adam.exp_avg_sq(), adam.max_exp_avg_sq()});
  };
  for (const auto& [param, state] : optimizer.state()) {
    const torch::optim::OptimizerParamState* s = state.get();
    if (const auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(s))
      add_moments(*adam);
    else if (const auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(s))
      add_moments(*adamw);
    else if (const auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(s))
      tensors.push_back(sgd->momentum_buffer());
    else if (const auto* adagrad = dynamic_cast<const torch::optim::AdagradParamState*>(s))
      tensors.push_back(adagrad->sum());
    else if (const auto* rmsprop = dynamic_cast<const torch::optim::RMSpropParamState*>(s))
      tensors.insert(tensors.end(), {rmsprop->square_avg(), rmsprop->momentum_buffer(), rmsprop->grad_avg()});
  }
  return tensors;
}

}  // namespace nanguard::detail
