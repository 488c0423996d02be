// loss_scaler.h — dynamic loss scaling with torch.cuda.amp.GradScaler's
// semantics and defaults, plus optional hysteresis and a minimum scale.
//
// The scaler only keeps the scale: the sentinel reads the scaled gradients
// once (norms reported unscaled) and the guard unscales and clips them in one
// write, so scaling costs no pass of its own.
//
//   nanguard::loss_scaler scaler(nanguard::loss_scaler_options().init_scale(1024));
//   scaler.scale(loss).backward();
//   auto r = sentinel.inspect_grads(scaler.inv_scale());
//   if (r.finite()) { sentinel.apply_factor_(scaler.inv_scale()); optimizer.step(); }
//   scaler.update(!r.finite());   // grows, or backs off on overflow
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstdint>

namespace nanguard {

/// Options of a `loss_scaler`; defaults are GradScaler's.
struct loss_scaler_options {
  /// false: scale() returns the loss as is and the scale stays 1.
  TORCH_ARG(bool, enabled) = true;
  /// The first scale, 2^16.
  TORCH_ARG(double, init_scale) = 65536.0;
  /// Factor applied after growth_interval finite steps in a row.
  TORCH_ARG(double, growth_factor) = 2.0;
  /// Factor applied on overflow.
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Finite steps in a row before the scale grows.
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// Overflowing steps in a row before the scale backs off (1: every one).
  TORCH_ARG(int64_t, hysteresis) = 1;
  /// Backing off below this throws: the overflow is not a scaling problem.
  TORCH_ARG(double, min_scale) = 1.0;
  /// The scale never grows above this.
  TORCH_ARG(double, max_scale) = 16777216.0;
};

/// Keeps the loss scale of mixed-precision (float16 or bfloat16) training.
class loss_scaler {
 public:
  /// Validates the options (factors, interval, bounds).
  explicit loss_scaler(loss_scaler_options options = {});
  /// `loss * scale()` (the loss itself when disabled).
  at::Tensor scale(const at::Tensor& loss) const;
  /// The current scale (1 when disabled).
  double get_scale() const { return options_.enabled() ? scale_ : 1.0; }
  /// 1 / get_scale(): the factor that unscales gradients.
  double inv_scale() const { return 1.0 / get_scale(); }
  /// Records a step: backs off on overflow (after `hysteresis` in a row),
  /// grows after `growth_interval` finite steps. Returns true when the scale
  /// changed. Throws c10::Error when backing off would go below min_scale.
  bool update(bool found_nonfinite);
  /// True unless made disabled.
  bool enabled() const { return options_.enabled(); }
  /// Finite steps since the last change of scale.
  int64_t growth_tracker() const { return growth_tracker_; }
  /// Sets the scale (e.g. when resuming from a checkpoint).
  void set_scale(double scale);
  /// The options it was made with.
  const loss_scaler_options& options() const { return options_; }

 private:
  loss_scaler_options options_;
  double scale_;
  int64_t growth_tracker_ = 0;
  int64_t overflows_in_a_row_ = 0;
};

}  // namespace nanguard
