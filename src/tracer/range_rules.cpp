#include "range_rules.h"

#include "detail/dtype_limits.h"
#include "detail/op_tensors.h"

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <string_view>
#include <unordered_map>

namespace nanguard::detail {
namespace {

// Relative error of one rounded float32 operation, with a factor 2 to
// spare (float64 rounds finer). Transcendental kernels (exp, tanh) are
// within a few units in the last place: they count as kTranscendental.
constexpr double kRounding = 0x1p-23;
constexpr double kTranscendental = 8;
// Rules take no argument beyond this magnitude: their kernels' inner
// arithmetic (squares in a variance, cubes in tanh-approximated GELU)
// stays finite below it in float32.
constexpr double kLargestArgument = 1e12;

maybe_range rounded(maybe_range r, double operations) {
  if (!r) return r;
  return r->widened(operations * kRounding);
}

// The range of a sum of `terms` values, each in r (zero when there are none).
value_range summed(const value_range& r, double terms) {
  return value_range{r.lo * terms, r.hi * terms}.hull(value_range::of(0)).widened((terms + 1) * kRounding);
}

// Product of the sizes of `dims` of `t` (all of them when `dims` is None
// or empty): how many values a reduction over them adds.
double reduced_count(const at::Tensor& t, const c10::IValue& dims) {
  if (!dims.isIntList() || dims.toIntList().empty()) return double(t.numel());
  double n = 1;
  for (const int64_t d : dims.toIntList()) n *= double(t.size(d));
  return n;
}

// ----------------------------------------------------------------- rules

maybe_range zero(const op_arguments&, size_t) { return value_range::of(0); }
maybe_range one(const op_arguments&, size_t) { return value_range::of(1); }
maybe_range zero_or_one(const op_arguments&, size_t) { return value_range{0, 1}; }

template <size_t Arg>
maybe_range copy_of(const op_arguments& a, size_t) {
  return a.range(Arg);
}

template <size_t Arg1, size_t Arg2>
maybe_range either_of(const op_arguments& a, size_t) {
  const maybe_range x = a.range(Arg1), y = a.range(Arg2);
  if (!x || !y) return c10::nullopt;
  return x->hull(*y);
}

maybe_range list_of(const op_arguments& a, size_t) { return a.list_range(0); }

// relu, clamp_min: max(x, floor).
maybe_range at_least(const value_range& x, double floor) {
  return value_range{std::max(x.lo, floor), std::max(x.hi, floor)};
}

maybe_range relu(const op_arguments& a, size_t) {
  const maybe_range x = a.range(0);
  return x ? at_least(*x, 0) : x;
}

maybe_range clamp_min(const op_arguments& a, size_t) {
  const maybe_range x = a.range(0), floor = a.range(1);
  return x && floor ? at_least(*x, floor->lo) : c10::nullopt;
}

// threshold_backward(grad, self, threshold): the gradient or zero.
maybe_range gradient_or_zero(const op_arguments& a, size_t) {
  const maybe_range g = a.range(0);
  return g ? maybe_range(g->hull(value_range::of(0))) : c10::nullopt;
}

// add(self, other, alpha), sub(...): self + sign * alpha * other; and
// rsub(self, other, alpha): other - alpha * self (X = 1, Y = 0).
template <size_t X, size_t Y, int Sign>
maybe_range add(const op_arguments& a, size_t) {
  const maybe_range x = a.range(X), y = a.range(Y);
  const double alpha = Sign * a.number(2, 1.0);
  if (!x || !y || !std::isfinite(alpha)) return c10::nullopt;
  const value_range scaled = alpha == 1 ? *y : (*y * alpha).widened(kRounding);
  return rounded(*x + scaled, 1);
}

maybe_range neg(const op_arguments& a, size_t) {
  const maybe_range x = a.range(0);
  return x ? maybe_range(-*x) : x;
}

// One product, nothing computed inside it: any finite factors (Adam's
// second moment, bounded by the square of a gradient's bound, times beta2).
maybe_range mul(const op_arguments& a, size_t) {
  const maybe_range x = a.any_finite_range(0), y = a.any_finite_range(1);
  return x && y ? rounded(*x * *y, 1) : c10::nullopt;
}

// div(self, other, rounding_mode): a floor or truncation lies between the
// floor and the ceiling of the quotient's bounds.
maybe_range div(const op_arguments& a, size_t) {
  const maybe_range x = a.range(0), y = a.range(1);
  if (!x || !y || y->contains_zero()) return c10::nullopt;
  value_range q = (*x / *y).widened(2 * kRounding);
  if (a.size() > 2 && a[2].isString()) q = {std::floor(q.lo), std::ceil(q.hi)};
  return q;
}

// A function increasing on x, with its domain's lower end.
template <double (*F)(double)>
maybe_range increasing(const maybe_range& x, double domain_lo, bool open) {
  if (!x || x->lo < domain_lo || (open && x->lo == domain_lo)) return c10::nullopt;
  return rounded(value_range{F(x->lo), F(x->hi)}, kTranscendental);
}

double sqrt_of(double x) { return std::sqrt(x); }
double rsqrt_of(double x) { return 1 / std::sqrt(x); }
double exp_of(double x) { return std::exp(x); }
double log_of(double x) { return std::log(x); }
double tanh_of(double x) { return std::tanh(x); }
double sigmoid_of(double x) { return 1 / (1 + std::exp(-x)); }

// sqrt and log map any finite argument in their domain to a finite value
// and compute nothing else: they take arguments past kLargestArgument
// (Adam's second moment, bounded by the square of a gradient's bound).
maybe_range sqrt_rule(const op_arguments& a, size_t) { return increasing<sqrt_of>(a.any_finite_range(0), 0, false); }
maybe_range log_rule(const op_arguments& a, size_t) { return increasing<log_of>(a.any_finite_range(0), 0, true); }
maybe_range exp_rule(const op_arguments& a, size_t) { return increasing<exp_of>(a.range(0), -INFINITY, false); }
maybe_range tanh_rule(const op_arguments& a, size_t) { return increasing<tanh_of>(a.range(0), -INFINITY, false); }
maybe_range sigmoid_rule(const op_arguments& a, size_t) {
  return increasing<sigmoid_of>(a.range(0), -INFINITY, false);
}

maybe_range rsqrt_rule(const op_arguments& a, size_t) {
  const maybe_range x = a.range(0);
  if (!x || x->lo <= 0) return c10::nullopt;
  return rounded(value_range{rsqrt_of(x->hi), rsqrt_of(x->lo)}, kTranscendental);
}

// gelu(x) = x * Phi(x): at most x above zero, at least -0.17 below.
maybe_range gelu(const op_arguments& a, size_t) {
  const maybe_range x = a.range(0);
  if (!x) return x;
  return rounded(value_range{x->lo >= 0 ? 0.0 : -0.18, std::max(x->hi, 0.0)}, kTranscendental);
}

// gelu_backward(grad, self): |gelu'| < 1.13 (erf or tanh form).
maybe_range gelu_backward(const op_arguments& a, size_t) {
  const maybe_range g = a.range(0), x = a.range(1);
  if (!g || !x) return c10::nullopt;
  return value_range::symmetric(1.2 * g->magnitude());
}

// lerp(self, end, weight): self + weight * (end - self), a number or a
// tensor weight (AdamW's first moment in torch 2.x). ATen computes it from
// either end; both forms lie in the same interval.
maybe_range lerp(const op_arguments& a, size_t) {
  const maybe_range x = a.range(0), y = a.range(1), w = a.range(2);
  if (!x || !y || !w) return c10::nullopt;
  return rounded(*x + (*y + -*x) * *w, 3);
}

// _softmax(self, dim, half_to_float): probabilities, for finite input.
maybe_range softmax(const op_arguments& a, size_t) {
  return a.range(0) ? rounded(value_range{0, 1}, kTranscendental) : c10::nullopt;
}

// _log_softmax(self, dim, ...): x - max - log(sum exp(x - max)), at least
// (lo - hi) - log(n) and at most 0; one unit of room either side.
maybe_range log_softmax(const op_arguments& a, size_t) {
  const maybe_range x = a.range(0);
  const at::Tensor* t = a.tensor(0);
  if (!x || !t || !a[1].isInt()) return c10::nullopt;
  const double n = double(t->size(a[1].toInt()));
  return value_range{x->lo - x->hi - std::log(n) - 1, 1};
}

// _softmax_backward_data(grad, output, dim, dtype): y * (g - sum(g * y)).
maybe_range softmax_backward(const op_arguments& a, size_t) {
  const maybe_range g = a.range(0), y = a.range(1);
  const at::Tensor* t = a.tensor(1);
  if (!g || !y || !t || !a[2].isInt()) return c10::nullopt;
  const double n = double(t->size(a[2].toInt()));
  const double gm = g->magnitude(), ym = y->magnitude();
  return value_range::symmetric(ym * (gm + n * gm * ym)).widened((n + 4) * kRounding);
}

// _log_softmax_backward_data(grad, output, dim, dtype): g - exp(y) * sum(g).
maybe_range log_softmax_backward(const op_arguments& a, size_t) {
  const maybe_range g = a.range(0), y = a.range(1);
  const at::Tensor* t = a.tensor(1);
  if (!g || !y || !t || !a[2].isInt()) return c10::nullopt;
  const double n = double(t->size(a[2].toInt()));
  const double gm = g->magnitude();
  return value_range::symmetric(gm + std::exp(y->hi) * n * gm).widened((n + kTranscendental) * kRounding);
}

// sum(self, dim, keepdim, dtype) / sum(self, dtype).
maybe_range sum(const op_arguments& a, size_t) {
  const maybe_range x = a.range(0);
  const at::Tensor* t = a.tensor(0);
  if (!x || !t) return c10::nullopt;
  return summed(*x, reduced_count(*t, a.size() > 1 ? a[1] : c10::IValue()));
}

// mean(...): within the values' range, give or take the sum's rounding.
maybe_range mean(const op_arguments& a, size_t) {
  const maybe_range x = a.range(0);
  const at::Tensor* t = a.tensor(0);
  if (!x || !t) return c10::nullopt;
  return x->widened((reduced_count(*t, a.size() > 1 ? a[1] : c10::IValue()) + 2) * kRounding);
}

// A matrix product's entries: sums of `depth` products of an entry of each.
value_range products(const value_range& x, const value_range& y, double depth) {
  return summed((x * y).widened(kRounding), depth);
}

// mm(self, mat2), bmm(self, mat2): depth is self's last size.
maybe_range matrix_product(const op_arguments& a, size_t) {
  const maybe_range x = a.range(0), y = a.range(1);
  const at::Tensor* t = a.tensor(0);
  if (!x || !y || !t || t->dim() < 2) return c10::nullopt;
  return products(*x, *y, double(t->size(-1)));
}

// addmm(self, mat1, mat2, beta, alpha), baddbmm(...): beta * self + alpha *
// mat1 @ mat2, where beta = 0 ignores self (even a NaN in it).
maybe_range add_matrix_product(const op_arguments& a, size_t) {
  const maybe_range m1 = a.range(1), m2 = a.range(2);
  const at::Tensor* t = a.tensor(1);
  const double beta = a.number(3, 1.0), alpha = a.number(4, 1.0);
  if (!m1 || !m2 || !t || t->dim() < 2 || !std::isfinite(beta) || !std::isfinite(alpha)) return c10::nullopt;
  const value_range prod = (products(*m1, *m2, double(t->size(-1))) * alpha).widened(kRounding);
  if (beta == 0) return prod;
  const maybe_range self = a.range(0);
  if (!self) return c10::nullopt;
  return rounded((*self * beta).widened(kRounding) + prod, 1);
}

value_range square(const value_range& x) {
  if (x.lo >= 0) return {x.lo * x.lo, x.hi * x.hi};
  if (x.hi <= 0) return {x.hi * x.hi, x.lo * x.lo};
  return {0, std::max(x.lo * x.lo, x.hi * x.hi)};
}

// addcmul(self, t1, t2, value): self + value * t1 * t2 (a square when t1
// and t2 are one tensor, as Adam's second moment has it). Only the product
// is computed inside: self may be any finite range.
maybe_range addcmul(const op_arguments& a, size_t) {
  const maybe_range s = a.any_finite_range(0), x = a.range(1), y = a.range(2);
  const double value = a.number(3, 1.0);
  if (!s || !x || !y || !std::isfinite(value)) return c10::nullopt;
  const at::Tensor *t1 = a.tensor(1), *t2 = a.tensor(2);
  const bool same = t1 && t2 && t1->data_ptr() == t2->data_ptr() && t1->dtype() == t2->dtype() &&
                    t1->sizes() == t2->sizes() && t1->strides() == t2->strides();  // grad and grad.conj()
  const value_range prod = (same ? square(*x) : *x * *y).widened(kRounding);
  return rounded(*s + (prod * value).widened(kRounding), 1);
}

// addcdiv(self, t1, t2, value): self + value * t1 / t2, t2 away from zero.
maybe_range addcdiv(const op_arguments& a, size_t) {
  const maybe_range s = a.range(0), x = a.range(1), y = a.range(2);
  const double value = a.number(3, 1.0);
  if (!s || !x || !y || y->contains_zero() || !std::isfinite(value)) return c10::nullopt;
  return rounded(*s + ((*x / *y).widened(kRounding) * value).widened(kRounding), 1);
}

// native_layer_norm(input, normalized_shape, weight, bias, eps) -> (out,
// mean, rstd). A normalised value is at most sqrt(n) in magnitude.
maybe_range layer_norm(const op_arguments& a, size_t index) {
  const maybe_range x = a.range(0);
  const double eps = a.number(4, NAN);
  const at::Tensor* input = a.tensor(0);
  if (!x || !input || !(eps > 0)) return c10::nullopt;
  double n = double(input->numel());  // at most; exact from normalized_shape when it reads as ints
  if (a[1].isIntList()) {
    n = 1;
    for (const int64_t s : a[1].toIntList()) n *= double(s);
  }
  if (index == 1) return x->widened((n + 2) * kRounding);
  if (index == 2) return value_range{0, 1 / std::sqrt(eps)}.widened(kTranscendental * kRounding);
  const maybe_range w = a.tensor(2) ? a.range(2) : maybe_range(value_range::of(1));
  const maybe_range b = a.tensor(3) ? a.range(3) : maybe_range(value_range::of(0));
  if (!w || !b) return c10::nullopt;
  return (value_range::symmetric(std::sqrt(n)) * *w + *b).widened((n + kTranscendental) * kRounding);
}

// embedding_dense_backward(grad, indices, ...): each row sums the
// gradients of the positions that looked it up.
maybe_range embedding_backward(const op_arguments& a, size_t) {
  const maybe_range g = a.range(0);
  const at::Tensor* indices = a.tensor(1);
  return g && indices ? maybe_range(summed(*g, double(indices->numel()))) : c10::nullopt;
}

// -------------------------------------------------------------- the table

const std::unordered_map<std::string_view, range_rule>& rules() {
  static const std::unordered_map<std::string_view, range_rule> table = [] {
    std::unordered_map<std::string_view, range_rule> t;
    const auto copies = [&](std::initializer_list<const char*> ops, decltype(range_rule::output) f) {
      for (const char* op : ops) t[op] = {f, true};
    };
    const auto computes = [&](std::initializer_list<const char*> ops, decltype(range_rule::output) f) {
      for (const char* op : ops) t[op] = {f, false};
    };
    copies({"aten::zeros", "aten::zeros_like", "aten::zero_", "aten::new_zeros"}, zero);
    copies({"aten::ones", "aten::ones_like", "aten::new_ones"}, one);
    copies({"aten::eye", "aten::bernoulli", "aten::bernoulli_"}, zero_or_one);
    copies({"aten::fill_", "aten::full", "aten::full_like"}, copy_of<1>);
    copies({"aten::new_full"}, copy_of<2>);
    copies({"aten::clone", "aten::_to_copy", "aten::index_select", "aten::gather",
            "aten::embedding", "aten::repeat"},
           copy_of<0>);
    copies({"aten::copy_"}, copy_of<1>);
    copies({"aten::masked_fill", "aten::masked_fill_"}, either_of<0, 2>);
    copies({"aten::where"}, either_of<1, 2>);
    copies({"aten::cat", "aten::stack"}, list_of);
    copies({"aten::relu", "aten::relu_"}, relu);
    copies({"aten::clamp_min", "aten::clamp_min_"}, clamp_min);
    copies({"aten::threshold_backward"}, gradient_or_zero);
    // The gradient placed into zeros of the input's shape (the backward of
    // q, k, v = proj[0], proj[1], proj[2] in torch 2.x's attention).
    copies({"aten::select_backward", "aten::slice_backward"}, gradient_or_zero);
    copies({"aten::neg", "aten::neg_"}, neg);
    computes({"aten::add", "aten::add_"}, add<0, 1, 1>);
    computes({"aten::sub", "aten::sub_"}, add<0, 1, -1>);
    computes({"aten::rsub"}, add<1, 0, -1>);
    computes({"aten::mul", "aten::mul_"}, mul);
    computes({"aten::div", "aten::div_"}, div);
    computes({"aten::sqrt", "aten::sqrt_"}, sqrt_rule);
    computes({"aten::rsqrt", "aten::rsqrt_"}, rsqrt_rule);
    computes({"aten::exp", "aten::exp_"}, exp_rule);
    computes({"aten::log", "aten::log_"}, log_rule);
    computes({"aten::tanh", "aten::tanh_"}, tanh_rule);
    computes({"aten::sigmoid", "aten::sigmoid_"}, sigmoid_rule);
    computes({"aten::gelu", "aten::gelu_"}, gelu);
    computes({"aten::gelu_backward"}, gelu_backward);
    // _safe_softmax (torch 2.x attention) is 0 on a row of -inf, which has no range.
    computes({"aten::_softmax", "aten::_safe_softmax"}, softmax);
    computes({"aten::lerp", "aten::lerp_"}, lerp);
    computes({"aten::_log_softmax"}, log_softmax);
    computes({"aten::_softmax_backward_data"}, softmax_backward);
    computes({"aten::_log_softmax_backward_data"}, log_softmax_backward);
    computes({"aten::sum"}, sum);
    computes({"aten::mean"}, mean);
    computes({"aten::mm", "aten::bmm"}, matrix_product);
    computes({"aten::addmm", "aten::addmm_", "aten::baddbmm", "aten::baddbmm_"}, add_matrix_product);
    computes({"aten::addcmul", "aten::addcmul_"}, addcmul);
    computes({"aten::addcdiv", "aten::addcdiv_"}, addcdiv);
    computes({"aten::native_layer_norm"}, layer_norm);
    computes({"aten::embedding_dense_backward"}, embedding_backward);
    return t;
  }();
  return table;
}

}  // namespace

maybe_range op_arguments::range(size_t i) const {
  const maybe_range r = any_finite_range(i);
  return r && r->magnitude() <= kLargestArgument ? r : c10::nullopt;
}

maybe_range op_arguments::any_finite_range(size_t i) const {
  if (i >= args_.size()) return c10::nullopt;
  const c10::IValue& v = args_[i];
  maybe_range r;
  if (v.isDouble() || v.isInt() || v.isBool()) {
    r = value_range::of(number(i, NAN));
  } else if (const at::Tensor* t = tensor(i)) {
    if (t->dim() == 0 && t->is_cpu()) r = value_range::of(number(i, NAN));
    else if (t->is_floating_point()) r = range_of_(*t);
  }
  return r && r->finite() ? r : c10::nullopt;
}

maybe_range op_arguments::list_range(size_t i) const {
  if (i >= args_.size() || !args_[i].isTensorList()) return c10::nullopt;
  maybe_range hull;
  for (const at::Tensor& t : args_[i].toTensorVector()) {
    if (t.numel() == 0) continue;
    const maybe_range r = t.is_floating_point() ? range_of_(t) : c10::nullopt;
    if (!r || !r->finite() || r->magnitude() > kLargestArgument) return c10::nullopt;
    hull = hull ? hull->hull(*r) : *r;
  }
  return hull;
}

double op_arguments::number(size_t i, double absent) const {
  if (i >= args_.size() || args_[i].isNone()) return absent;
  const c10::IValue& v = args_[i];
  if (v.isDouble()) return v.toDouble();
  if (v.isInt()) return double(v.toInt());
  if (v.isBool()) return v.toBool() ? 1 : 0;
  const at::Tensor* t = tensor(i);
  if (!t || t->dim() != 0 || !t->is_cpu() || !holds_values(*t)) return NAN;
  switch (t->scalar_type()) {
    case at::kDouble: return *t->data_ptr<double>();
    case at::kFloat: return double(*t->data_ptr<float>());
    case at::kHalf: return double(float(*t->data_ptr<at::Half>()));
    case at::kBFloat16: return double(float(*t->data_ptr<at::BFloat16>()));
    case at::kLong: return double(*t->data_ptr<int64_t>());
    case at::kInt: return double(*t->data_ptr<int32_t>());
    case at::kBool: return *t->data_ptr<bool>() ? 1 : 0;
    default: return NAN;
  }
}

const at::Tensor* op_arguments::tensor(size_t i) const {
  if (i >= args_.size() || !args_[i].isTensor()) return nullptr;
  const at::Tensor& t = args_[i].toTensor();
  return t.defined() ? &t : nullptr;
}

const range_rule* range_rule_for(const char* op_name) {
  const auto& table = rules();
  const auto it = table.find(op_name);
  return it == table.end() ? nullptr : &it->second;
}

maybe_range stored_range(const value_range& r, at::ScalarType dtype, const range_rule& rule) {
  const bool wide = dtype == at::kFloat || dtype == at::kDouble;
  if (!rule.copies_values && !wide) return c10::nullopt;
  // Storing rounds each value once to the dtype (a number into a float32
  // tensor, a float32 into a float16 one), with a factor 2 to spare.
  const double unit = dtype == at::kDouble ? 0x1p-52 : dtype == at::kFloat ? 0x1p-23 : 0x1p-7;
  const value_range stored = r.widened(unit);
  if (!stored.finite() || stored.magnitude() >= largest_finite(dtype)) return c10::nullopt;
  return stored;
}

}  // namespace nanguard::detail
