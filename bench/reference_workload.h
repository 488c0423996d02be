// reference_workload.h — the training step every overhead figure is measured
// on (../shared/DESIGN.md): a 4-layer TransformerEncoder (d=256, 4 heads,
// ff=1024, dropout 0.1), batch 16 × 64 tokens, linear head to 10 classes,
// AdamW, clip_grad_norm_(1.0), 2 threads.
#pragma once

#include "timing.h"

#include <torch/torch.h>

namespace nanguard::bench {

/// The model: token embedding, transformer encoder, mean pool, linear head.
struct reference_model_impl : torch::nn::Module {
  torch::nn::Embedding embed{nullptr};
  torch::nn::TransformerEncoder encoder{nullptr};
  torch::nn::Linear head{nullptr};

  reference_model_impl() {
    embed = register_module("embed", torch::nn::Embedding(1000, 256));
    encoder = register_module(
        "encoder", torch::nn::TransformerEncoder(torch::nn::TransformerEncoderOptions(
                       torch::nn::TransformerEncoderLayerOptions(256, 4).dim_feedforward(1024).dropout(0.1), 4)));
    head = register_module("head", torch::nn::Linear(256, 10));
  }

  /// tokens: [64, 16] (sequence first, as LibTorch 1.13's encoder wants).
  at::Tensor forward(const at::Tensor& tokens) {
    return head(encoder(embed(tokens)).mean(0));
  }
};
TORCH_MODULE_IMPL(reference_model, reference_model_impl);

/// A model, its optimizer and one fixed batch.
struct reference_workload {
  reference_model model;
  torch::optim::AdamW optimizer;
  at::Tensor tokens = torch::randint(1000, {64, 16});
  at::Tensor labels = torch::randint(10, {16});

  reference_workload()
      : optimizer(model->parameters(), torch::optim::AdamWOptions(1e-4)) {}

  /// Forward and loss: the closure a guarded loop replays.
  at::Tensor loss() { return torch::nn::functional::cross_entropy(model->forward(tokens), labels); }

  /// One plain step: zero_grad, forward, backward, clip, AdamW.
  float plain_step() {
    optimizer.zero_grad();
    at::Tensor l = loss();
    l.backward();
    torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
    optimizer.step();
    return l.item<float>();
  }
};

}  // namespace nanguard::bench
