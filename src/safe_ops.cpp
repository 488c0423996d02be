#include "nanguard/safe_ops.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>

namespace nanguard {
namespace {

void check_eps(double eps, const char* fn) {
  TORCH_CHECK(eps > 0 && std::isfinite(eps), "nanguard::", fn, ": eps must be finite and positive but is ",
              eps, "; use e.g. 1e-12");
}

struct safe_sqrt_fn : public torch::autograd::Function<safe_sqrt_fn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, double eps) {
    ctx->save_for_backward({x});
    ctx->saved_data["eps"] = eps;
    return at::sqrt(at::clamp_min(x, 0));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    const double eps = ctx->saved_data["eps"].toDouble();
    const at::Tensor g = grad_out[0] * 0.5 / at::sqrt(at::clamp_min(x, eps));
    return {at::where(x > 0, g, at::zeros_like(g)), at::Tensor()};
  }
};

}  // namespace

at::Tensor safe_div(const at::Tensor& a, const at::Tensor& b, double eps) {
  check_eps(eps, "safe_div");
  const at::Tensor sign = at::where(b < 0, at::full({}, -1.0, b.options()), at::full({}, 1.0, b.options()));
  return a / at::where(b.abs() < eps, sign * eps, b);
}

at::Tensor safe_log(const at::Tensor& x, double eps) {
  check_eps(eps, "safe_log");
  return at::log(at::clamp_min(x, eps));
}

at::Tensor safe_sqrt(const at::Tensor& x, double eps) {
  check_eps(eps, "safe_sqrt");
  return safe_sqrt_fn::apply(x, eps);
}

at::Tensor standardize(const at::Tensor& x, int64_t dim, double eps) {
  check_eps(eps, "standardize");
  const at::Tensor mean = x.mean(dim, /*keepdim=*/true);
  const at::Tensor centered = x - mean;
  const at::Tensor var = (centered * centered).mean(dim, /*keepdim=*/true);
  return centered * at::rsqrt(var + eps);
}

at::Tensor layer_norm(const at::Tensor& x, at::IntArrayRef normalized_shape, const at::Tensor& weight,
                      const at::Tensor& bias, double eps) {
  check_eps(eps, "layer_norm");
  const int64_t k = int64_t(normalized_shape.size());
  TORCH_CHECK(k >= 1 && k <= x.dim() && x.sizes().slice(x.dim() - k).equals(normalized_shape),
              "nanguard::layer_norm: normalized_shape ", normalized_shape, " must be the trailing dims of the "
              "input's shape ", x.sizes());
  std::vector<int64_t> dims;
  for (int64_t d = x.dim() - k; d < x.dim(); ++d) dims.push_back(d);
  const at::Tensor mean = x.mean(dims, /*keepdim=*/true);
  const at::Tensor centered = x - mean;
  const at::Tensor var = (centered * centered).mean(dims, /*keepdim=*/true);
  at::Tensor y = centered * at::rsqrt(var + eps);
  if (weight.defined()) y = y * weight;
  if (bias.defined()) y = y + bias;
  return y;
}

at::Tensor log_softmax(const at::Tensor& x, int64_t dim) {
  const at::Tensor shifted = x - std::get<0>(x.max(dim, /*keepdim=*/true)).detach();
  return shifted - shifted.exp().sum(dim, /*keepdim=*/true).log();
}

at::Tensor masked_softmax(const at::Tensor& x, const at::Tensor& mask, int64_t dim) {
  TORCH_CHECK_TYPE(mask.scalar_type() == at::kBool, "nanguard::masked_softmax: the mask must be bool "
                   "(true = left out) but is ", mask.scalar_type(),
                   "; pass e.g. `at::arange(t) >= lengths.unsqueeze(1)`");
  if (x.numel() == 0) return at::softmax(x, dim);
  const at::Tensor masked = mask.expand_as(x);
  // The max of the kept positions (finite in a fully masked row too), and no
  // exp of anything above 0, even in the branch `where` leaves out: its
  // gradient would be 0 * inf = NaN.
  const at::Tensor max = at::where(masked, x.detach().amin(), x.detach()).amax(dim, /*keepdim=*/true);
  const at::Tensor zero = at::zeros({}, x.options());
  const at::Tensor e = at::where(masked, zero, at::where(masked, zero, x - max).exp());
  // A row with a kept position sums to >= 1 (its max gives exp(0)); a fully
  // masked row sums to 0 and stays 0.
  return e / e.sum(dim, /*keepdim=*/true).clamp_min(1);
}

at::Tensor nll_loss(const at::Tensor& log_probs, const at::Tensor& target) {
  TORCH_CHECK(log_probs.dim() == 2 && target.dim() == 1 && target.size(0) == log_probs.size(0),
              "nanguard::nll_loss: expected log_probs N x C and target N but got ", log_probs.sizes(),
              " and ", target.sizes());
  return -log_probs.gather(1, target.unsqueeze(1)).mean();
}

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& target, double label_smoothing) {
  TORCH_CHECK(label_smoothing >= 0 && label_smoothing < 1,
              "nanguard::cross_entropy: label_smoothing must be in [0, 1) but is ", label_smoothing);
  TORCH_CHECK(logits.dim() == 2, "nanguard::cross_entropy: expected logits N x C but got ", logits.sizes());
  const at::Tensor logp = nanguard::log_softmax(logits, 1);
  const at::Tensor nll = nanguard::nll_loss(logp, target);
  if (label_smoothing == 0) return nll;
  const at::Tensor smooth = -logp.mean(1).mean();
  return (1 - label_smoothing) * nll + label_smoothing * smooth;
}

}  // namespace nanguard
