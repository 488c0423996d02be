// schedule.h — learning-rate schedule: linear warmup, then cosine decay to a
// floor. Works with any torch::optim optimizer: it sets the lr of every
// param group.
//
//   nanguard::warmup_cosine sched(nanguard::schedule_options(3e-4).warmup_steps(500).total_steps(20000));
//   for (int64_t step = 0; step < 20000; ++step) {
//     sched.apply(optimizer, step);
//     // ... train one step ...
//   }
#pragma once

#include <torch/arg.h>

#include <cstdint>

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace nanguard {

/// Options of `warmup_cosine`.
struct schedule_options {
  /// REQUIRES: base_lr > 0.
  /* implicit */ schedule_options(double base_lr) : base_lr_(base_lr) {}
  /// The peak learning rate, reached at the end of warmup.
  TORCH_ARG(double, base_lr);
  /// Steps of linear warmup: step s < warmup_steps gets base_lr * (s + 1) / warmup_steps.
  TORCH_ARG(int64_t, warmup_steps) = 0;
  /// The step at which the cosine reaches the floor (and stays).
  TORCH_ARG(int64_t, total_steps) = 1000;
  /// The floor of the decay (PyTorch's eta_min).
  TORCH_ARG(double, min_lr) = 0.0;
};

/// Linear warmup, then cosine annealing from base_lr to min_lr.
class warmup_cosine {
 public:
  /// Validates the options (positive lr, warmup < total, min_lr <= base_lr).
  explicit warmup_cosine(schedule_options options);
  /// The learning rate at 0-based `step`.
  double lr(int64_t step) const;
  /// Sets every param group's lr to lr(step) * factor; returns that lr.
  double apply(torch::optim::Optimizer& optimizer, int64_t step, double factor = 1.0) const;
  /// The options it was made with.
  const schedule_options& options() const { return options_; }

 private:
  schedule_options options_;
};

/// The lr of the first param group (0 when there is none).
double get_lr(const torch::optim::Optimizer& optimizer);
/// Sets the lr of every param group.
void set_lr(torch::optim::Optimizer& optimizer, double lr);
/// Multiplies the lr of every param group by `factor`.
void scale_lr(torch::optim::Optimizer& optimizer, double factor);

}  // namespace nanguard
