#include "nanguard/clip.h"

#include "nanguard/census.h"
#include "nanguard/sentinel.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>

namespace nanguard {

double clip_coefficient(double total_norm, double max_norm) {
  if (max_norm <= 0 || !std::isfinite(total_norm)) return 1.0;
  return std::min(1.0, max_norm / (total_norm + 1e-6));
}

double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm) {
  TORCH_CHECK(max_norm > 0 && std::isfinite(max_norm),
              "nanguard::clip_grad_norm_: max_norm must be finite and positive but is ", max_norm,
              "; use e.g. 1.0, or do not call it to disable clipping");
  std::vector<std::pair<std::string, at::Tensor>> named;
  named.reserve(parameters.size());
  for (size_t i = 0; i < parameters.size(); ++i) named.emplace_back(std::to_string(i), parameters[i]);
  const sentinel s(std::move(named));
  const grad_report r = s.inspect_grads();
  if (r.finite()) s.apply_factor_(clip_coefficient(r.total_norm, max_norm));
  return r.total_norm;
}

int64_t clip_grad_value_(const std::vector<at::Tensor>& parameters, double clip_value, bool zero_nan) {
  TORCH_CHECK(clip_value > 0 && std::isfinite(clip_value),
              "nanguard::clip_grad_value_: clip_value must be finite and positive but is ", clip_value,
              "; use e.g. 5.0");
  at::NoGradGuard no_grad;
  int64_t nans = 0;
  for (const at::Tensor& p : parameters) {
    at::Tensor g = p.grad();
    if (!g.defined()) continue;
    if (has_nonfinite(g)) {
      const at::Tensor nan_mask = at::isnan(g);
      nans += nan_mask.sum().item<int64_t>();
      if (zero_nan) g.masked_fill_(nan_mask, 0);
    }
    g.clamp_(-clip_value, clip_value);
  }
  return nans;
}

}  // namespace nanguard
