#include "nanguard/sentinel.h"

#include "nanguard/nonfinite_record.h"
#include "nanguard/spelling.h"

#include "nanguard/census.h"

#include "census/census_kernels.h"
#include "detail/median.h"
#include "detail/root_sum_squares.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace nanguard {
namespace {

// Elements per work item of the fused pass: big gradients split, so two
// threads share even one large matrix; small ones are one item each.
constexpr int64_t kItem = int64_t(1) << 16;
// Gradients of fewer elements in all are read (and scaled) on the calling
// thread: waking a worker (OMP_WAIT_POLICY=passive, tens of microseconds on
// 2 cores) costs more than it saves (a 2-layer BERT's 171k: 17 us on one
// thread, 35 us on two).
constexpr int64_t kParallelElements = int64_t(1) << 18;

struct work_item {
  int64_t param;
  int64_t start;
  int64_t len;
};

// Whether the fused kernels read (and scale) gradient `g`: a contiguous
// float32/float64 CPU one.
bool fused(const at::Tensor& g) {
  return g.layout() == at::kStrided && g.is_cpu() && g.is_contiguous() &&
         (g.scalar_type() == at::kFloat || g.scalar_type() == at::kDouble);
}

// Appends the work items of gradient `param`, of `numel` elements.
void add_items(std::vector<work_item>& items, int64_t param, int64_t numel) {
  for (int64_t s = 0; s < numel; s += kItem) items.push_back({param, s, std::min(kItem, numel - s)});
}

// fn(k) for each of `items` (`elements` in all): on at::parallel_for's
// threads when they are worth waking.
template <typename F>
void for_each_item(const std::vector<work_item>& items, int64_t elements, const F& fn) {
  const int64_t n = int64_t(items.size());
  if (elements < kParallelElements) {
    for (int64_t k = 0; k < n; ++k) fn(k);
    return;
  }
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) fn(k);
  });
}

// x[0, n) *= factor: what at::mul_ writes (a float32 tensor is multiplied
// by the factor as a float32).
template <typename T>
void scale(T* x, int64_t n, T factor) {
  for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}

double median_of(std::vector<double>& v) {
  const size_t mid = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + mid, v.end());
  double m = v[mid];
  if (v.size() % 2 == 0) m = detail::midpoint(*std::max_element(v.begin(), v.begin() + mid), m);
  return m;
}

}  // namespace

spike_detector::spike_detector(spike_options options) : options_(std::move(options)) {
  TORCH_CHECK(options_.window() >= 3, "nanguard::spike_options: window must be at least 3 but is ",
              options_.window(), "; set ", spelled("spike_options().window(50)", "spike_window=50"), " or larger");
  TORCH_CHECK(options_.min_samples() >= 3 && options_.min_samples() <= options_.window(),
              "nanguard::spike_options: min_samples must be in [3, window=", options_.window(),
              "] but is ", options_.min_samples(), "; lower min_samples or raise window");
  TORCH_CHECK(options_.threshold() > 0, "nanguard::spike_options: threshold must be positive but is ",
              options_.threshold(), "; a robust z-score of 6 to 10 is typical");
}

double spike_detector::observe(double x) {
  if (!std::isfinite(x)) return 0;
  double z = 0;
  if (int64_t(values_.size()) >= options_.min_samples()) {
    std::vector<double> v(values_.begin(), values_.end());
    const double med = median_of(v);
    double mean_ad = 0;
    for (double& e : v) {
      e = std::fabs(e - med);
      mean_ad += e;
    }
    mean_ad /= double(v.size());
    const double mad = median_of(v);
    // MAD is 0 when over half the window is one value: fall back to the mean
    // absolute deviation (Iglewicz & Hoaglin), floored so a flat window is
    // not set off by rounding jitter.
    const double floor = 1e-6 * std::max(1.0, std::fabs(med));
    z = mad > 0 ? 0.6745 * (x - med) / std::max(mad, floor)
                : (x - med) / std::max(1.253314 * mean_ad, floor);
  }
  values_.push_back(x);
  if (int64_t(values_.size()) > options_.window()) values_.pop_front();
  return z;
}

std::string to_string(const spike& s) { return fmt::format("{} {:.6g} (z={:.3g})", s.series, s.value, s.z); }

sentinel::sentinel(std::vector<std::pair<std::string, at::Tensor>> named_parameters,
                   spike_options spikes)
    : loss_spikes_(spikes), norm_spikes_(spikes) {
  names_.reserve(named_parameters.size());
  params_.reserve(named_parameters.size());
  for (auto& [name, p] : named_parameters) {
    TORCH_CHECK(p.defined(), "nanguard::sentinel: parameter '", name,
                "' is undefined; pass the module's named_parameters()");
    names_.push_back(name);
    params_.push_back(p);
  }
}

bool sentinel::check_loss(const at::Tensor& loss, double* value) const {
  TORCH_CHECK(loss.defined() && loss.numel() == 1,
              "nanguard::sentinel::check_loss: the loss must hold one element but ",
              loss.defined() ? "has shape " + c10::str(loss.sizes()) : std::string("is undefined"),
              "; reduce it first (e.g. loss.mean())");
  const double v = loss.item<double>();
  if (value) *value = v;
  return std::isfinite(v);
}

grad_report sentinel::inspect_grads(double inv_scale) const {
  TORCH_CHECK(std::isfinite(inv_scale) && inv_scale > 0,
              "nanguard::sentinel::inspect_grads: inv_scale must be finite and positive but is ",
              inv_scale, "; pass 1 / loss_scale");
  const int64_t n = int64_t(params_.size());
  grad_report r;
  r.norms.assign(n, 0.0);
  r.nonfinite_counts.assign(n, 0);
  std::vector<double> sumsq(n, 0.0);

  // Contiguous float32/float64 CPU gradients go through the fused kernel;
  // anything else (float16, bfloat16, strided, other devices) through one
  // census_many: on CUDA, many gradients per launch and one host sync.
  std::vector<work_item> items;
  int64_t elements = 0;
  std::vector<at::Tensor> grads(n);  // what is measured of each gradient
  std::vector<at::Tensor> others;
  std::vector<int64_t> other_params;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& g = params_[i].grad();
    if (!g.defined() || g.numel() == 0) continue;
    grads[i] = g;
    if (!fused(g)) {
      // Sparse gradients (Embedding(sparse=true)) are measured by their values.
      const bool strided = g.layout() == at::kStrided;
      grads[i] = strided ? g : g.is_sparse() ? g.coalesce().values() : g.to_dense();
      others.push_back(grads[i]);
      other_params.push_back(i);
      continue;
    }
    add_items(items, i, g.numel());
    elements += g.numel();
  }
  std::vector<detail::sumsq_partial> parts(items.size());
  for_each_item(items, elements, [&](int64_t k) {
    const work_item& w = items[k];
    const at::Tensor& g = grads[w.param];
    parts[k] = g.scalar_type() == at::kFloat ? detail::sumsq_f32(g.data_ptr<float>() + w.start, w.len)
                                             : detail::sumsq_f64(g.data_ptr<double>() + w.start, w.len);
  });
  for (size_t k = 0; k < items.size(); ++k) {
    sumsq[items[k].param] += parts[k].sumsq;
    r.nonfinite_counts[items[k].param] += parts[k].nonfinite;
  }
  std::vector<double> norms(n);
  for (int64_t i = 0; i < n; ++i) norms[i] = std::sqrt(sumsq[i]);
  const std::vector<tensor_stats> other_stats = census_many(others);
  for (size_t k = 0; k < others.size(); ++k) {
    sumsq[other_params[k]] = other_stats[k].l2_norm * other_stats[k].l2_norm;
    norms[other_params[k]] = other_stats[k].l2_norm;
    r.nonfinite_counts[other_params[k]] = other_stats[k].nonfinite();
  }
  double total = 0;
  for (int64_t i = 0; i < n; ++i) {
    // A float64 gradient beyond 1e154 squares past float64's range in the
    // fused pass: the census measures it again, scaled.
    if (std::isinf(norms[i]) && r.nonfinite_counts[i] == 0) norms[i] = census(grads[i]).l2_norm;
    r.norms[i] = norms[i] * inv_scale;
    total += sumsq[i];
    if (r.nonfinite_counts[i] > 0) {
      if (r.nonfinite == 0) r.first_nonfinite_name = names_[i];
      r.nonfinite += r.nonfinite_counts[i];
      r.norms[i] = std::numeric_limits<double>::quiet_NaN();
    }
  }
  if (r.nonfinite > 0) r.total_norm = std::numeric_limits<double>::quiet_NaN();
  else r.total_norm = (std::isfinite(total) ? std::sqrt(total) : detail::root_sum_squares(norms)) * inv_scale;
  return r;
}

void sentinel::apply_factor_(double factor) const {
  if (factor == 1.0) return;
  at::NoGradGuard no_grad;
  // The gradients the fused pass reads are scaled by plain loops over the
  // same work items (at::mul_ costs microseconds of dispatch per tensor:
  // most of the write for a model of many small parameters), their
  // versions bumped as mul_ does. The other dense ones by one multi-tensor
  // write: on CUDA, a few launches for all of them.
  std::vector<work_item> items;
  int64_t elements = 0;
  std::vector<at::Tensor> grads(params_.size());
  std::vector<at::Tensor> dense;
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor g = params_[i].grad();
    if (!g.defined()) continue;
    if (fused(g)) {
      g.unsafeGetTensorImpl()->bump_version();
      add_items(items, int64_t(i), g.numel());
      elements += g.numel();
      grads[i] = g;
    } else if (g.layout() == at::kStrided) {
      dense.push_back(g);
    } else {
      g.mul_(factor);
    }
  }
  for_each_item(items, elements, [&](int64_t k) {
    const work_item& w = items[k];
    const at::Tensor& g = grads[w.param];
    if (g.scalar_type() == at::kFloat)
      scale(g.data_ptr<float>() + w.start, w.len, static_cast<float>(factor));
    else
      scale(g.data_ptr<double>() + w.start, w.len, factor);
  });
  if (!dense.empty()) at::_foreach_mul_(dense, factor);
}

std::vector<spike> sentinel::observe(double loss, double grad_norm) {
  std::vector<spike> out;
  const double zl = loss_spikes_.observe(loss);
  if (loss_spikes_.is_spike(zl)) out.push_back({"loss", loss, zl});
  const double zn = norm_spikes_.observe(grad_norm);
  if (norm_spikes_.is_spike(zn)) out.push_back({"grad_norm", grad_norm, zn});
  loss_trend_.add(loss);
  norm_trend_.add(grad_norm);
  return out;
}

std::optional<range_forecast> sentinel::forecast(double loss_limit, double norm_limit) const {
  std::optional<range_forecast> loss = loss_trend_.forecast("loss", loss_limit);
  std::optional<range_forecast> norm = norm_trend_.forecast("grad_norm", norm_limit);
  if (!loss || (norm && norm->steps_left < loss->steps_left)) return norm;
  return loss;
}

}  // namespace nanguard
