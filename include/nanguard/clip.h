// clip.h — gradient clipping by global norm and by value, aware of NaN/Inf.
//
// Clipping by norm needs the global norm the sentinel already computed, so
// the guard calls `clip_coefficient` and folds it into the unscale write.
// The standalone functions do the sentinel's pass themselves:
//
//   double norm = nanguard::clip_grad_norm_(model->parameters(), 1.0);
//   if (!std::isfinite(norm)) { /* gradients left untouched: skip the step */ }
//   nanguard::clip_grad_value_(model->parameters(), 5.0);
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace nanguard {

/// The factor, <= 1, that brings `total_norm` down to `max_norm`
/// (PyTorch's max_norm / (norm + 1e-6), capped at 1); 1 when max_norm <= 0
/// (no clipping) or when the norm is not finite (nothing sensible to scale).
double clip_coefficient(double total_norm, double max_norm);

/// Clips the gradients of `parameters` to global L2 norm `max_norm` with
/// one fused read (sentinel pass) and at most one write. Returns the norm
/// before clipping; NaN or Inf when a gradient is not finite, in which case
/// the gradients are left as they are (so the caller can skip the step).
///
/// REQUIRES: max_norm > 0.
double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm);

/// Clamps every gradient element to [-clip_value, clip_value]: ±Inf become
/// ±clip_value. NaN stays NaN (so the step is still seen as bad) unless
/// `zero_nan` is set, then it becomes 0. Returns the number of NaN found.
///
/// REQUIRES: clip_value > 0.
int64_t clip_grad_value_(const std::vector<at::Tensor>& parameters, double clip_value,
                         bool zero_nan = false);

}  // namespace nanguard
