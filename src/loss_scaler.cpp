#include "nanguard/loss_scaler.h"

#include <ATen/ATen.h>

#include <cmath>

namespace nanguard {

loss_scaler::loss_scaler(loss_scaler_options options) : options_(std::move(options)) {
  const auto& o = options_;
  TORCH_CHECK(std::isfinite(o.init_scale()) && o.init_scale() > 0,
              "nanguard::loss_scaler_options: init_scale must be finite and positive but is ",
              o.init_scale(), "; the usual value is 65536 (2^16)");
  TORCH_CHECK(o.growth_factor() > 1, "nanguard::loss_scaler_options: growth_factor must be > 1 but is ",
              o.growth_factor(), "; the usual value is 2");
  TORCH_CHECK(o.backoff_factor() > 0 && o.backoff_factor() < 1,
              "nanguard::loss_scaler_options: backoff_factor must be in (0, 1) but is ",
              o.backoff_factor(), "; the usual value is 0.5");
  TORCH_CHECK(o.growth_interval() >= 1, "nanguard::loss_scaler_options: growth_interval must be >= 1 but is ",
              o.growth_interval(), "; the usual value is 2000");
  TORCH_CHECK(o.hysteresis() >= 1, "nanguard::loss_scaler_options: hysteresis must be >= 1 but is ",
              o.hysteresis(), "; 1 backs off on every overflow");
  TORCH_CHECK(o.min_scale() > 0 && o.min_scale() <= o.init_scale() && o.init_scale() <= o.max_scale(),
              "nanguard::loss_scaler_options: need 0 < min_scale <= init_scale <= max_scale but got ",
              o.min_scale(), ", ", o.init_scale(), ", ", o.max_scale(), "; adjust the bounds");
  scale_ = o.init_scale();
}

at::Tensor loss_scaler::scale(const at::Tensor& loss) const {
  if (!options_.enabled()) return loss;
  return loss * scale_;
}

void loss_scaler::set_scale(double scale) {
  TORCH_CHECK(std::isfinite(scale) && scale >= options_.min_scale() && scale <= options_.max_scale(),
              "nanguard::loss_scaler::set_scale: scale must be in [min_scale=", options_.min_scale(),
              ", max_scale=", options_.max_scale(), "] but is ", scale);
  scale_ = scale;
  growth_tracker_ = 0;
  overflows_in_a_row_ = 0;
}

bool loss_scaler::update(bool found_nonfinite) {
  if (!options_.enabled()) return false;
  if (found_nonfinite) {
    growth_tracker_ = 0;
    if (++overflows_in_a_row_ < options_.hysteresis()) return false;
    overflows_in_a_row_ = 0;
    const double next = scale_ * options_.backoff_factor();
    TORCH_CHECK(next >= options_.min_scale(),
                "nanguard::loss_scaler: the loss scale would fall to ", next, ", below min_scale=",
                options_.min_scale(), " after repeated non-finite gradients: the NaN/Inf is not a "
                "float16 overflow (look at the tracer's finding), or lower min_scale");
    scale_ = next;
    return true;
  }
  overflows_in_a_row_ = 0;
  if (++growth_tracker_ < options_.growth_interval()) return false;
  growth_tracker_ = 0;
  const double next = std::min(scale_ * options_.growth_factor(), options_.max_scale());
  const bool changed = next != scale_;
  scale_ = next;
  return changed;
}

}  // namespace nanguard
