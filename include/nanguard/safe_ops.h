// safe_ops.h — numerically safe versions of the ops that most often make a
// NaN or Inf: division, log, sqrt, normalisation, (masked) softmax and
// cross-entropy.
// On ordinary inputs they match LibTorch's ops (to 1e-6); on extreme ones
// (logits ±1e4, zero variance, zeros) they and their gradients stay finite.
//
//   at::Tensor y = nanguard::safe_div(x, x.norm());              // no 0/0
//   at::Tensor h = nanguard::layer_norm(x, {256}, w, b);          // zero-variance rows are fine
//   at::Tensor l = nanguard::cross_entropy(logits, target, 0.1);  // label smoothing 0.1
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace nanguard {

/// a / b with |b| raised to at least eps (keeping its sign, 0 → +eps).
at::Tensor safe_div(const at::Tensor& a, const at::Tensor& b, double eps = 1e-12);

/// log(max(x, eps)): finite for x <= 0, gradient 0 there.
at::Tensor safe_log(const at::Tensor& x, double eps = 1e-12);

/// sqrt(max(x, 0)) with a finite gradient everywhere: 0 for x <= 0, and
/// 0.5 / sqrt(max(x, eps)) above (bounded near 0 instead of Inf).
at::Tensor safe_sqrt(const at::Tensor& x, double eps = 1e-12);

/// (x - mean) / sqrt(var + eps) over `dim` (biased variance), keepdim.
at::Tensor standardize(const at::Tensor& x, int64_t dim = -1, double eps = 1e-5);

/// Layer norm over the trailing `normalized_shape` dims, then weight and
/// bias (either may be undefined); matches at::layer_norm.
at::Tensor layer_norm(const at::Tensor& x, at::IntArrayRef normalized_shape,
                      const at::Tensor& weight = {}, const at::Tensor& bias = {}, double eps = 1e-5);

/// log_softmax over `dim` with the max subtracted first; matches at::log_softmax.
at::Tensor log_softmax(const at::Tensor& x, int64_t dim = -1);

/// softmax over `dim` of `x` leaving out the positions where the bool `mask`
/// (broadcastable to `x`) is true, as `x.masked_fill(mask, -inf)` would; a
/// row whose every position is masked gives zeros (at::softmax gives NaN),
/// and so does its gradient. Matches at::softmax elsewhere.
///
///   at::Tensor causal = at::ones({t, t}, at::kBool).triu(1);
///   at::Tensor p = nanguard::masked_softmax(scores, causal | key_padding, -1);
at::Tensor masked_softmax(const at::Tensor& x, const at::Tensor& mask, int64_t dim = -1);

/// Mean negative log-likelihood of class indices `target` (N) under
/// log-probabilities `log_probs` (N x C).
at::Tensor nll_loss(const at::Tensor& log_probs, const at::Tensor& target);

/// Mean cross-entropy of logits (N x C) and class indices (N), with label
/// smoothing in [0, 1); matches at::cross_entropy_loss.
at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& target, double label_smoothing = 0.0);

}  // namespace nanguard
