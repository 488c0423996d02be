// reference_workload.h — the training step every overhead figure is measured
// on (../shared/DESIGN.md): a 4-layer TransformerEncoder (d=256, 4 heads,
// ff=1024, dropout 0.1), batch 16 × 64 tokens, linear head to 10 classes,
// AdamW, clip_grad_norm_(1.0), 2 threads.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <vector>

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

/// Seconds one call of `fn` takes.
inline double seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// The median of `v`.
inline double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

/// Runs the variants round-robin for `rounds` rounds, after one warm-up
/// each, the order rotating every round so that no variant always follows
/// the same one; returns seconds per call as [variant][round]. Side by side,
/// slow phases of a shared machine hit every variant alike.
inline std::vector<std::vector<double>> interleaved_seconds(const std::vector<std::function<void()>>& variants,
                                                            int rounds) {
  for (const auto& v : variants) v();
  std::vector<std::vector<double>> times(variants.size());
  for (int r = 0; r < rounds; ++r)
    for (size_t k = 0; k < variants.size(); ++k) {
      const size_t i = (k + size_t(r)) % variants.size();
      times[i].push_back(seconds(variants[i]));
    }
  return times;
}

/// Each variant's median seconds per call, measured by interleaved_seconds.
inline std::vector<double> median_seconds(const std::vector<std::function<void()>>& variants, int rounds) {
  std::vector<double> medians;
  for (auto& t : interleaved_seconds(variants, rounds)) medians.push_back(median(t));
  return medians;
}

/// How much slower a variant is than the baseline: the median over rounds
/// of the ratio of their times in the same round, and a 95% confidence
/// interval for it (distribution-free, from the order statistics).
struct ratio_estimate {
  double median, low, high;
};

inline ratio_estimate paired_ratio(const std::vector<double>& variant, const std::vector<double>& baseline) {
  std::vector<double> r;
  for (size_t i = 0; i < variant.size() && i < baseline.size(); ++i) r.push_back(variant[i] / baseline[i]);
  std::sort(r.begin(), r.end());
  const double n = double(r.size()), half_width = 0.98 * std::sqrt(n);  // 1.96 sigma of Binomial(n, 1/2)
  const auto at = [&](double k) { return r[size_t(std::clamp(k, 0.0, n - 1))]; };
  return {median(r), at(std::floor(n / 2 - half_width)), at(std::ceil(n / 2 + half_width) - 1)};
}

}  // namespace nanguard::bench
