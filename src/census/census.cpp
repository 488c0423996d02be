#include "nanguard/census.h"

#include "nanguard/float_formats.h"
#include "nanguard/spelling.h"

#include "detail/chunked_parallel.h"
#include "detail/op_tensors.h"
#include "detail/root_sum_squares.h"
#include "detail/value_range.h"
#include "census_kernels.h"
#include "census_paths.h"
#ifdef NANGUARD_WITH_CUDA
#include "cuda_record.h"
#endif

#include <ATen/Dispatch.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/aminmax.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/isnan.h>
#include <ATen/ops/isneginf.h>
#include <ATen/ops/isposinf.h>
#include <ATen/ops/view_as_real.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <ostream>

namespace nanguard {
namespace {

using detail::census_partial;

// Elements per parallel task: large enough to amortise scheduling, small
// enough that two threads share a 2^20-element tensor.
constexpr int64_t kChunk = int64_t(1) << 16;
// float16/bfloat16 are widened to float in stack buffers of this size.
constexpr int64_t kWidenBlock = 4096;

// CUDA tensors are read by nanguard's kernel where it is built (one pass,
// one host sync: cuda_record, as a nonfinite_record of one tensor would);
// tensors on other devices with ATen ops.
constexpr bool kCudaKernels =
#ifdef NANGUARD_WITH_CUDA
    true;
#else
    false;
#endif

bool on_cuda_kernel(const at::Tensor& x) { return kCudaKernels && x.is_cuda(); }

// The census (`stats`) or the verdict alone of `x`, a float tensor on a CUDA
// device, by nanguard's kernel. REQUIRES: on_cuda_kernel(x).
#ifdef NANGUARD_WITH_CUDA
tensor_stats census_by_cuda_kernel(const at::Tensor& x) {
  detail::cuda_record record(x.device(), /*stats=*/true);
  record.add(x, int64_t(0));
  return record.stats().at(0);
}

bool nonfinite_by_cuda_kernel(const at::Tensor& x) {
  detail::cuda_record record(x.device(), /*stats=*/false);
  record.add(x, int64_t(0));
  const detail::cuda_verdict v = record.verdict();
  return v.nan + v.pos_inf + v.neg_inf > 0;
}
#else
tensor_stats census_by_cuda_kernel(const at::Tensor&) {
  TORCH_INTERNAL_ASSERT(false, "nanguard: built without the CUDA kernels (a bug in nanguard: please report it)");
}

bool nonfinite_by_cuda_kernel(const at::Tensor&) {
  TORCH_INTERNAL_ASSERT(false, "nanguard: built without the CUDA kernels (a bug in nanguard: please report it)");
}
#endif

// A tensor whose values can be read: defined, strided, not on the meta device.
void check_has_data(const at::Tensor& x, const char* fn) {
  TORCH_CHECK(x.defined(), "nanguard::", fn, ": the tensor is undefined; pass a tensor that holds data");
  TORCH_CHECK(x.layout() == at::kStrided, "nanguard::", fn, ": expected a dense (strided) tensor but got layout ",
              x.layout(), " with shape ", x.sizes(), "; pass x.to_dense(), or the sparse tensor's values()");
  TORCH_CHECK(!x.is_meta(), "nanguard::", fn, ": the tensor with shape ", x.sizes(),
              " is on the meta device and holds no values; pass a tensor on the CPU or a GPU");
  TORCH_CHECK(x.numel() == 0 || detail::holds_values(x), "nanguard::", fn, ": the tensor with shape ", x.sizes(),
              " stands for values it does not hold (a FakeTensor, or a wrapper of torch.func / vmap / "
              "torch.compile while it traces); call ", fn, " outside the transform, on the real tensor");
}

void check_floating(const at::Tensor& x, const char* fn) {
  check_has_data(x, fn);
  const auto t = x.scalar_type();
  TORCH_CHECK_TYPE(!x.is_complex(), "nanguard::", fn, ": expected a real floating-point tensor but got ", t,
                   " with shape ", x.sizes(), "; take the census of the real and imaginary parts, ",
                   spelled("at::view_as_real(x)", "torch.view_as_real(x)"));
  TORCH_CHECK_TYPE(detail::census_dtype(t), "nanguard::", fn, ": expected a float32, float64, float16 or bfloat16 tensor "
                   "but got ", t, " with shape ", x.sizes(),
                   x.is_floating_point() ? "; convert with " : "; integer and bool tensors cannot hold NaN or Inf "
                                                               "(convert with ",
                   spelled("x.to(at::kFloat)", "x.float()"),
                   x.is_floating_point() ? " (NaN and Inf are kept) to measure it" : " to measure them anyway)");
}

template <typename T>
struct kernel;

template <>
struct kernel<float> {
  static census_partial census(const float* x, int64_t n, int64_t base) {
    return detail::census_f32(x, n, base, FLT_MIN);
  }
};

template <>
struct kernel<double> {
  static census_partial census(const double* x, int64_t n, int64_t base) {
    return detail::census_f64(x, n, base, DBL_MIN);
  }
};

// 16-bit floats: widen to float, keep the source dtype's subnormal bound.
template <typename T>
struct widening_kernel {
  static census_partial census(const T* x, int64_t n, int64_t base) {
    const float subnormal_below =
        std::is_same_v<T, c10::Half> ? float(fp16_min_normal) : FLT_MIN;
    float buf[kWidenBlock];
    census_partial total;
    for (int64_t i = 0; i < n; i += kWidenBlock) {
      const int64_t len = std::min(kWidenBlock, n - i);
      for (int64_t k = 0; k < len; ++k) buf[k] = static_cast<float>(x[i + k]);
      total.merge(detail::census_f32(buf, len, base + i, subnormal_below));
    }
    return total;
  }
};
template <>
struct kernel<c10::Half> : widening_kernel<c10::Half> {};
template <>
struct kernel<c10::BFloat16> : widening_kernel<c10::BFloat16> {};

template <typename T>
census_partial census_contiguous(const at::Tensor& x) {
  const T* data = x.data_ptr<T>();
  const int64_t n = x.numel();
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<census_partial> parts(chunks);
  detail::for_each_chunk(chunks, [&](int64_t c) {
    const int64_t start = c * kChunk;
    parts[c] = kernel<T>::census(data + start, std::min(kChunk, n - start), start);
  });
  census_partial total;
  for (const auto& p : parts) total.merge(p);  // in order: first_bad stays the first
  return total;
}

tensor_stats to_stats(const census_partial& p) {
  tensor_stats s;
  s.numel = p.numel;
  s.nan = p.nan;
  s.pos_inf = p.pos_inf;
  s.neg_inf = p.neg_inf;
  s.finite = p.finite;
  s.zeros = p.zeros;
  s.subnormal = p.subnormal;
  s.fp16_overflow = p.fp16_overflow;
  s.fp16_underflow = p.fp16_underflow;
  s.bf16_overflow = p.bf16_overflow;
  s.first_nonfinite_index = p.first_bad;
  s.first_nonfinite_value = p.first_bad_value;
  if (p.finite > 0) {
    s.min = p.min;
    s.max = p.max;
    s.mean = p.mean;
    s.std = std::sqrt(p.m2 / double(p.finite));
    s.l2_norm = std::sqrt(p.m2 + double(p.finite) * p.mean * p.mean);
    s.absmax = std::max(std::fabs(p.min), std::fabs(p.max));
  }
  return s;
}

// Elements per has_nonfinite task: a scan is so cheap that waking a second
// thread only pays off for large tensors.
constexpr int64_t kScanChunk = int64_t(1) << 19;

template <typename F>
bool any_chunk(int64_t n, bool parallel, const F& chunk_has_nonfinite) {
  if (!parallel || n <= kScanChunk) return chunk_has_nonfinite(0, n);
  const int64_t chunks = (n + kScanChunk - 1) / kScanChunk;
  std::atomic<bool> found{false};
  detail::for_each_chunk(chunks, [&](int64_t c) {
    const int64_t start = c * kScanChunk;
    if (!found.load(std::memory_order_relaxed) && chunk_has_nonfinite(start, std::min(kScanChunk, n - start)))
      found.store(true, std::memory_order_relaxed);
  });
  return found.load();
}

// `x`'s elements as one block of memory, in some order: `x` itself when it
// is non-overlapping and dense (a transposed weight, a permuted activation),
// else a contiguous copy. For what does not depend on the order: whether a
// value is not finite, the range.
at::Tensor dense_block(const at::Tensor& x) { return x.is_non_overlapping_and_dense() ? x : x.contiguous(); }

bool scan_for_nonfinite(const at::Tensor& x, bool parallel, const char* caller) {
  check_has_data(x, caller);
  if (x.is_complex()) return scan_for_nonfinite(at::view_as_real(x), parallel, caller);
  if (!x.is_floating_point()) return false;
  // float8 and the like: no kernel here, nor an isfinite in ATen; float32 keeps their NaN and Inf.
  if (!detail::census_dtype(x.scalar_type())) return scan_for_nonfinite(x.to(at::kFloat), parallel, caller);
  if (!x.is_cpu()) return on_cuda_kernel(x) ? nonfinite_by_cuda_kernel(x) : !at::isfinite(x).all().item<bool>();
  const at::Tensor c = dense_block(x);
  const int64_t n = c.numel();
  switch (c.scalar_type()) {
    case at::kFloat: {
      const float* d = c.data_ptr<float>();
      return any_chunk(n, parallel, [&](int64_t s, int64_t len) { return detail::any_nonfinite_f32(d + s, len); });
    }
    case at::kDouble: {
      const double* d = c.data_ptr<double>();
      return any_chunk(n, parallel, [&](int64_t s, int64_t len) { return detail::any_nonfinite_f64(d + s, len); });
    }
    case at::kHalf:
    case at::kBFloat16: {
      const auto* d = static_cast<const uint16_t*>(c.data_ptr());
      const uint16_t mask = c.scalar_type() == at::kHalf ? 0x7C00 : 0x7F80;
      return any_chunk(n, parallel,
                       [&](int64_t s, int64_t len) { return detail::any_nonfinite_16bit(d + s, len, mask); });
    }
    default:
      TORCH_INTERNAL_ASSERT(false, "nanguard::", caller, ": no kernel for ", c.scalar_type());
  }
}

double smallest_normal(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return DBL_MIN;
    case at::kHalf: return fp16_min_normal;
    default: return FLT_MIN;  // float32 and bfloat16 share the exponent range
  }
}

// The census of a tensor census() accepts, on its own device, in one pass.
tensor_stats census_in_one_pass(const at::Tensor& x) {
  if (!x.is_cpu()) return on_cuda_kernel(x) ? census_by_cuda_kernel(x) : detail::census_aten(x);
  if (x.numel() == 0) return tensor_stats{};
  const at::Tensor c = detail::logical_values(x);
  census_partial p;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, c.scalar_type(), "nanguard::census",
                                  [&] { p = census_contiguous<scalar_t>(c); });
  return to_stats(p);
}

// Float64 values beyond ~1e154 can overflow the sums of values and squares
// behind mean, std and l2_norm even where those are representable: then
// they come out NaN or Inf from finite values.
bool moments_overflowed(const tensor_stats& s) {
  return s.finite > 0 && !(std::isfinite(s.mean) && std::isfinite(s.std) && std::isfinite(s.l2_norm));
}

// Mean, std and L2 norm measured again on `x` scaled by the power of two
// that brings absmax into [1, 2) (exact, as LAPACK's dnrm2 or std::hypot
// scale), then scaled back: Inf only where the statistic itself is beyond
// float64. The counts, min and max of the first pass stay.
void measure_moments_scaled(const at::Tensor& x, tensor_stats& s) {
  const int exponent = std::ilogb(s.absmax);
  const tensor_stats scaled = census_in_one_pass(x * std::ldexp(1.0, -exponent));
  s.mean = std::ldexp(scaled.mean, exponent);
  s.std = std::ldexp(scaled.std, exponent);
  s.l2_norm = std::ldexp(scaled.l2_norm, exponent);
}

}  // namespace

tensor_stats census(const at::Tensor& x) {
  check_floating(x, "census");
  tensor_stats s = census_in_one_pass(x);
  if (moments_overflowed(s)) measure_moments_scaled(x, s);  // rare: the fast pass stays one pass
  return s;
}

bool has_nonfinite(const at::Tensor& x) { return scan_for_nonfinite(x, /*parallel=*/true, "has_nonfinite"); }

namespace {

// The bounds of a range of floats Width bits wide from its extreme bit
// patterns. A NaN pattern lies above infinity's on its side; when no value
// is negative (or none non-negative), zero bounds that side.
template <int Width, typename Decode>
detail::value_range range_from(detail::extreme_bits e, uint64_t infinity_bits, Decode decode) {
  const uint64_t sign = uint64_t(1) << (Width - 1);
  const bool any_non_negative = (e.signed_max & sign) == 0, any_negative = (e.unsigned_max & sign) != 0;
  const bool nan = (any_non_negative && e.signed_max > infinity_bits) ||
                   (any_negative && (e.unsigned_max & ~sign) > infinity_bits);
  if (nan) return {NAN, NAN};
  return {any_negative ? decode(e.unsigned_max) : 0.0, any_non_negative ? decode(e.signed_max) : 0.0};
}

template <typename Bits, typename Float>
Float bit_cast(Bits bits) {
  Float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The range with ATen ops, on the tensor's own device.
detail::value_range range_by_aten(const at::Tensor& x) {
  if (!at::isfinite(x).all().item<bool>()) return {NAN, NAN};
  const auto [lo, hi] = at::aminmax(x);
  return {lo.item<double>(), hi.item<double>()};
}

}  // namespace

namespace detail {

value_range value_range_on_this_thread(const at::Tensor& x) {
  // Callers pass real_values() of measurable() tensors: no integer or bool
  // tensor (no NaN or Inf), no float8 (read as float32).
  TORCH_INTERNAL_ASSERT(x.defined() && census_dtype(x.scalar_type()), "nanguard::detail::value_range_on_this_thread: "
                        "expected a float32, float64, float16 or bfloat16 tensor but got ",
                        x.defined() ? c10::toString(x.scalar_type()) : "an undefined one",
                        " (a bug in nanguard: please report it)");
  if (x.numel() == 0) return {};
  if (x.is_neg()) return value_range_on_this_thread(x.resolve_neg());  // its memory holds the values negated
  if (on_cuda_kernel(x)) {
    // As range_from: zero bounds a side no value lies on.
    const tensor_stats s = census_by_cuda_kernel(x);
    return s.all_finite() ? value_range{std::min(s.min, 0.0), std::max(s.max, 0.0)} : value_range{NAN, NAN};
  }
  if (!x.is_cpu()) return range_by_aten(x);
  if (!x.is_non_overlapping_and_dense()) return value_range_on_this_thread(x.contiguous());
  const int64_t n = x.numel();
  switch (x.scalar_type()) {
    case at::kFloat:
      return range_from<32>(extremes_32bit(static_cast<const uint32_t*>(x.data_ptr()), n), 0x7F800000,
                            [](uint64_t b) { return double(bit_cast<uint32_t, float>(uint32_t(b))); });
    case at::kDouble:
      return range_from<64>(extremes_64bit(static_cast<const uint64_t*>(x.data_ptr()), n),
                            0x7FF0000000000000, [](uint64_t b) { return bit_cast<uint64_t, double>(b); });
    case at::kHalf:
      return range_from<16>(extremes_16bit(static_cast<const uint16_t*>(x.data_ptr()), n), 0x7C00,
                            [](uint64_t b) { return double(float(c10::Half(uint16_t(b), c10::Half::from_bits()))); });
    case at::kBFloat16:
      return range_from<16>(extremes_16bit(static_cast<const uint16_t*>(x.data_ptr()), n), 0x7F80,
                            [](uint64_t b) { return double(bit_cast<uint32_t, float>(uint32_t(b) << 16)); });
    default:
      TORCH_INTERNAL_ASSERT(false, "nanguard::detail::value_range_on_this_thread: no kernel for ", x.scalar_type(),
                            " (a bug in nanguard: please report it)");
  }
}

bool has_nonfinite_on_this_thread(const at::Tensor& x) {
  return scan_for_nonfinite(x, /*parallel=*/false, "has_nonfinite");
}

tensor_stats census_aten(const at::Tensor& x) {
  check_floating(x, "census");
  tensor_stats s;
  s.numel = x.numel();
  if (s.numel == 0) return s;
  const at::Tensor flat = x.reshape({-1});
  const at::Tensor finite_mask = at::isfinite(flat);
  const auto count = [](const at::Tensor& mask) { return mask.sum().item<int64_t>(); };
  s.nan = count(at::isnan(flat));
  s.pos_inf = count(at::isposinf(flat));
  s.neg_inf = count(at::isneginf(flat));
  const at::Tensor values = flat.to(at::kDouble).masked_select(finite_mask);
  s.finite = values.numel();
  if (s.nonfinite() > 0) {
    s.first_nonfinite_index = finite_mask.logical_not().to(at::kByte).argmax().item<int64_t>();
    s.first_nonfinite_value = flat[s.first_nonfinite_index].item<double>();
  }
  if (s.finite == 0) return s;
  const at::Tensor a = values.abs();
  s.zeros = count(a == 0);
  s.subnormal = count((a > 0) & (a < smallest_normal(x.scalar_type())));
  s.fp16_underflow = count((a > 0) & (a < fp16_min_normal));
  // As torch casts: float64 through float32, whose rounding can reach the threshold first.
  const at::Tensor cast_magnitude = a.to(at::kFloat);
  s.fp16_overflow = count(cast_magnitude >= float(fp16_rounds_to_inf));
  s.bf16_overflow = count(cast_magnitude >= float(bf16_rounds_to_inf));
  s.min = values.min().item<double>();
  s.max = values.max().item<double>();
  s.mean = values.mean().item<double>();
  s.std = values.std(/*unbiased=*/false).item<double>();
  s.l2_norm = values.norm().item<double>();
  s.absmax = a.max().item<double>();
  return s;
}

}  // namespace detail

namespace {

// The mean of the parts' `n` finite values, each part's weighted by its
// share: the form that stays finite where sum(mean * count) overflows.
double mean_of_means(const std::vector<tensor_stats>& parts, double n) {
  double mean = 0;
  for (const tensor_stats& p : parts)
    if (p.finite > 0) mean += static_cast<double>(p.finite) / n * p.mean;
  return mean;
}

// The pooled population standard deviation of the parts' `n` finite values
// around `mean`, summed scaled (the form that stays finite where the sum of
// squares overflows).
double pooled_std(const std::vector<tensor_stats>& parts, double n, double mean) {
  std::vector<double> spreads, weights;
  for (const tensor_stats& p : parts) {
    if (p.finite == 0) continue;
    const double w = static_cast<double>(p.finite) / n;
    spreads.insert(spreads.end(), {p.std, p.mean - mean});
    weights.insert(weights.end(), {w, w});
  }
  return detail::root_sum_squares(spreads, weights);
}

}  // namespace

tensor_stats merge_census(const std::vector<tensor_stats>& parts) {
  tensor_stats m;
  double sum = 0, sumsq_norm = 0;
  std::vector<double> norms;
  for (const tensor_stats& p : parts) {
    m.numel += p.numel;
    m.nan += p.nan;
    m.pos_inf += p.pos_inf;
    m.neg_inf += p.neg_inf;
    m.finite += p.finite;
    m.zeros += p.zeros;
    m.subnormal += p.subnormal;
    m.fp16_overflow += p.fp16_overflow;
    m.fp16_underflow += p.fp16_underflow;
    m.bf16_overflow += p.bf16_overflow;
    m.min = std::fmin(m.min, p.min);  // fmin/fmax skip a part without finite values (NaN)
    m.max = std::fmax(m.max, p.max);
    m.absmax = std::max(m.absmax, p.absmax);
    sumsq_norm += p.l2_norm * p.l2_norm;
    norms.push_back(p.l2_norm);
    if (p.finite > 0) sum += p.mean * static_cast<double>(p.finite);
    if (p.first_nonfinite_index >= 0 &&
        (m.first_nonfinite_index < 0 || p.first_nonfinite_index < m.first_nonfinite_index)) {
      m.first_nonfinite_index = p.first_nonfinite_index;
      m.first_nonfinite_value = p.first_nonfinite_value;
    }
  }
  // Float64 parts beyond 1e154 square past float64's range: summed again, scaled.
  m.l2_norm = std::isfinite(sumsq_norm) ? std::sqrt(sumsq_norm) : detail::root_sum_squares(norms);
  if (m.finite == 0) return m;
  const double n = static_cast<double>(m.finite);
  m.mean = sum / n;
  if (!std::isfinite(m.mean)) m.mean = mean_of_means(parts, n);
  // Pooled population variance: each part's own spread plus its mean's distance from the whole's.
  double m2 = 0;
  for (const tensor_stats& p : parts)
    if (p.finite > 0) m2 += static_cast<double>(p.finite) * (p.std * p.std + (p.mean - m.mean) * (p.mean - m.mean));
  m.std = std::isfinite(m2) ? std::sqrt(m2 / n) : pooled_std(parts, n, m.mean);
  return m;
}

std::string to_string(const tensor_stats& s) {
  std::string out = fmt::format(
      "n={} nan={} +inf={} -inf={} zero={} subnormal={} min={:.6g} max={:.6g} mean={:.6g} "
      "std={:.6g} l2={:.6g} absmax={:.6g} fp16_overflow={} fp16_underflow={} bf16_overflow={}",
      s.numel, s.nan, s.pos_inf, s.neg_inf, s.zeros, s.subnormal, s.min, s.max, s.mean, s.std,
      s.l2_norm, s.absmax, s.fp16_overflow, s.fp16_underflow, s.bf16_overflow);
  if (s.first_nonfinite_index >= 0)
    out += fmt::format(" first_nonfinite[{}]={}", s.first_nonfinite_index,
                       std::isnan(s.first_nonfinite_value) ? std::string("nan")
                                                           : fmt::format("{}", s.first_nonfinite_value));
  return out;
}

std::ostream& operator<<(std::ostream& os, const tensor_stats& s) { return os << to_string(s); }

}  // namespace nanguard
