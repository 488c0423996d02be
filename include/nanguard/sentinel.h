// sentinel.h — the always-on check of a training step: the loss before
// backward, and after backward one fused pass over every gradient that gives
// the global norm, the norm and non-finite count of each named parameter, and
// spike statistics. Clipping and unscaling reuse its norms: no second pass.
//
//   nanguard::sentinel s(model->named_parameters().pairs());
//   auto loss = torch::mse_loss(model->forward(x), y);
//   if (!s.check_loss(loss)) { /* skip: nothing to backward */ }
//   loss.backward();
//   nanguard::grad_report r = s.inspect_grads();
//   if (!r.finite()) std::cerr << r.first_nonfinite_name << "\n";
//   for (auto& spike : s.observe(loss.item<double>(), r.total_norm))
//     std::cerr << spike.series << " spiked: z = " << spike.z << "\n";
#pragma once

#include <nanguard/forecast.h>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

namespace nanguard {

/// Options of the spike detector (rolling robust z-score).
struct spike_options {
  /// Values kept in the rolling window.
  TORCH_ARG(int64_t, window) = 50;
  /// A value is a spike when 0.6745 * (x - median) / MAD exceeds this
  /// ((x - median) / (1.2533 * mean absolute deviation) when MAD is 0).
  TORCH_ARG(double, threshold) = 8.0;
  /// No spike is reported before the window holds this many values.
  TORCH_ARG(int64_t, min_samples) = 10;
};

/// Rolling robust z-score of one series (loss, grad norm, ...).
///
///   nanguard::spike_detector d(nanguard::spike_options().window(100));
///   if (d.observe(loss.item<double>()) > 8) std::cerr << "loss spike\n";
class spike_detector {
 public:
  /// REQUIRES: window >= 3, 3 <= min_samples <= window, threshold > 0.
  explicit spike_detector(spike_options options = {});
  /// The robust z-score of `x` against the window (0 while it is short),
  /// then adds `x` to the window. Non-finite values are scored 0, not added.
  double observe(double x);
  /// True when `z` (from observe) is above the threshold.
  bool is_spike(double z) const { return z > options_.threshold(); }
  /// Values in the window.
  int64_t size() const { return int64_t(values_.size()); }
  /// Forgets the window.
  void reset() { values_.clear(); }
  /// The options it was made with.
  const spike_options& options() const { return options_; }

 private:
  spike_options options_;
  std::deque<double> values_;
};

/// One spike: the series, its value and its robust z-score.
struct spike {
  std::string series;  ///< "loss" or "grad_norm"
  double value = 0;    ///< the value that spiked
  double z = 0;        ///< its robust z-score
};

/// What one pass over the gradients found. Norms are of the unscaled gradients.
struct grad_report {
  double total_norm = 0;            ///< global L2 norm (float64 ones beyond 1e154 too); NaN when one is not finite
  int64_t nonfinite = 0;            ///< NaN and Inf elements over every gradient
  std::vector<double> norms;        ///< per parameter (sentinel::names order); 0 without grad
  std::vector<int64_t> nonfinite_counts;  ///< per parameter
  std::string first_nonfinite_name;  ///< first parameter (in order) with a bad gradient
  /// True when every gradient is finite.
  bool finite() const { return nonfinite == 0; }
};

/// Checks a step's loss and gradients for NaN/Inf, cheaply enough to stay on.
///
/// NOTE: keeps the parameter tensors (not copies): the gradients it reads are
/// whatever `.grad()` holds when inspect_grads is called.
class sentinel {
 public:
  /// Watches `named_parameters` (e.g. `module.named_parameters().pairs()`).
  explicit sentinel(std::vector<std::pair<std::string, at::Tensor>> named_parameters,
                    spike_options spikes = {});

  /// The loss as a double, checked: false when it is NaN or Inf.
  ///
  /// REQUIRES: `loss` holds one element.
  bool check_loss(const at::Tensor& loss, double* value = nullptr) const;

  /// One fused pass over every gradient. With a loss scale in use pass
  /// `inv_scale` = 1/scale: the norms are reported unscaled (the gradients
  /// are not touched; apply_factor_ does the one write).
  grad_report inspect_grads(double inv_scale = 1.0) const;

  /// Multiplies every gradient by `factor` (unscale and clip in one write);
  /// does nothing when factor == 1.
  void apply_factor_(double factor) const;

  /// Scores loss and grad norm against their rolling windows; the spikes.
  /// Their trends (forecast()) follow them.
  std::vector<spike> observe(double loss, double grad_norm);
  /// The series that leaves its range first at the trend of the values
  /// observe() saw last: the loss against `loss_limit` (its dtype's largest
  /// value), the grad norm against `norm_limit` (the gradients' dtype's
  /// largest over the loss scale); none for a healthy run (range_trend).
  std::optional<range_forecast> forecast(double loss_limit, double norm_limit) const;

  /// Forgets the spike windows and the trends (e.g. after a rollback).
  void reset_spikes() {
    loss_spikes_.reset();
    norm_spikes_.reset();
    loss_trend_.reset();
    norm_trend_.reset();
  }

  /// Parameter names, in the order of grad_report's vectors.
  const std::vector<std::string>& names() const { return names_; }
  /// Parameters, in the same order.
  const std::vector<at::Tensor>& parameters() const { return params_; }

 private:
  std::vector<std::string> names_;
  std::vector<at::Tensor> params_;
  spike_detector loss_spikes_;
  spike_detector norm_spikes_;
  range_trend loss_trend_;
  range_trend norm_trend_;
};

/// `loss 12.5 (z=9.1)`.
std::string to_string(const spike& s);

}  // namespace nanguard
