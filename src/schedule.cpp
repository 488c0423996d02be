#include "nanguard/schedule.h"

#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>

#include <cmath>

namespace nanguard {

warmup_cosine::warmup_cosine(schedule_options options) : options_(std::move(options)) {
  const auto& o = options_;
  TORCH_CHECK(std::isfinite(o.base_lr()) && o.base_lr() > 0,
              "nanguard::schedule_options: base_lr must be finite and positive but is ", o.base_lr());
  TORCH_CHECK(o.warmup_steps() >= 0 && o.warmup_steps() < o.total_steps(),
              "nanguard::schedule_options: need 0 <= warmup_steps < total_steps but got warmup_steps=",
              o.warmup_steps(), ", total_steps=", o.total_steps(), "; lengthen total_steps");
  TORCH_CHECK(o.min_lr() >= 0 && o.min_lr() <= o.base_lr(),
              "nanguard::schedule_options: min_lr must be in [0, base_lr=", o.base_lr(), "] but is ",
              o.min_lr());
}

double warmup_cosine::lr(int64_t step) const {
  const auto& o = options_;
  TORCH_CHECK(step >= 0, "nanguard::warmup_cosine::lr: step must be >= 0 but is ", step);
  if (step < o.warmup_steps()) return o.base_lr() * double(step + 1) / double(o.warmup_steps());
  const double span = double(o.total_steps() - o.warmup_steps());
  const double t = std::min(double(step - o.warmup_steps()), span) / span;
  return o.min_lr() + (o.base_lr() - o.min_lr()) * 0.5 * (1.0 + std::cos(M_PI * t));
}

double warmup_cosine::apply(torch::optim::Optimizer& optimizer, int64_t step, double factor) const {
  const double v = lr(step) * factor;
  set_lr(optimizer, v);
  return v;
}

double get_lr(const torch::optim::Optimizer& optimizer) {
  const auto& groups = optimizer.param_groups();
  return groups.empty() ? 0.0 : groups.front().options().get_lr();
}

void set_lr(torch::optim::Optimizer& optimizer, double lr) {
  TORCH_CHECK(std::isfinite(lr) && lr >= 0, "nanguard::set_lr: lr must be finite and >= 0 but is ", lr);
  for (auto& g : optimizer.param_groups()) g.options().set_lr(lr);
}

void scale_lr(torch::optim::Optimizer& optimizer, double factor) {
  TORCH_CHECK(std::isfinite(factor) && factor > 0,
              "nanguard::scale_lr: factor must be finite and positive but is ", factor);
  for (auto& g : optimizer.param_groups()) g.options().set_lr(g.options().get_lr() * factor);
}

}  // namespace nanguard
