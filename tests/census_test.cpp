#include "nanguard/census.h"
#include "nanguard/spelling.h"

#include "census/census_kernels.h"
#include "census/census_paths.h"
#include "detail/value_range.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>
#include <random>

namespace {

using nanguard::tensor_stats;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double smallest_normal(at::ScalarType t) {
  if (t == at::kDouble) return DBL_MIN;
  if (t == at::kHalf) return 6.103515625e-05;
  return FLT_MIN;
}

// The reference: a plain scalar loop in long double over the logical
// elements, independent of the library's kernels.
tensor_stats reference(const at::Tensor& x) {
  const at::Tensor d = x.to(at::kDouble).contiguous().reshape({-1});
  const double* v = d.data_ptr<double>();
  tensor_stats s;
  s.numel = d.numel();
  long double sum = 0, sumsq = 0;
  for (int64_t i = 0; i < s.numel; ++i) {
    const double e = v[i];
    if (!std::isfinite(e)) {
      (std::isnan(e) ? s.nan : e > 0 ? s.pos_inf : s.neg_inf)++;
      if (s.first_nonfinite_index < 0) {
        s.first_nonfinite_index = i;
        s.first_nonfinite_value = e;
      }
      continue;
    }
    const double a = std::fabs(e);
    s.finite++;
    s.zeros += a == 0;
    s.subnormal += a > 0 && a < smallest_normal(x.scalar_type());
    s.fp16_underflow += a > 0 && a < 6.103515625e-05;
    s.fp16_overflow += std::isinf(float(c10::Half(float(e))));  // torch casts float64 through float32
    s.bf16_overflow += std::isinf(float(c10::BFloat16(float(e))));
    s.min = s.finite == 1 ? e : std::min(s.min, e);
    s.max = s.finite == 1 ? e : std::max(s.max, e);
    s.absmax = std::max(s.absmax, a);
    sum += e;
    sumsq += (long double)e * e;
  }
  if (s.finite > 0) {
    const long double n = s.finite, mean = sum / n;
    long double m2 = 0;
    for (int64_t i = 0; i < s.numel; ++i)
      if (std::isfinite(v[i])) m2 += (v[i] - mean) * (v[i] - mean);
    s.mean = double(mean);
    s.std = double(std::sqrt(m2 / n));
    s.l2_norm = double(std::sqrt(sumsq));
  }
  return s;
}

void expect_close(double expected, double actual, double rel, const char* what) {
  if (std::isnan(expected)) {
    EXPECT_TRUE(std::isnan(actual)) << what << ": expected NaN, got " << actual;
    return;
  }
  EXPECT_NEAR(expected, actual, rel * std::max(1.0, std::fabs(expected))) << what;
}

void expect_matches(const tensor_stats& want, const tensor_stats& got, double rel) {
  EXPECT_EQ(want.numel, got.numel);
  EXPECT_EQ(want.nan, got.nan);
  EXPECT_EQ(want.pos_inf, got.pos_inf);
  EXPECT_EQ(want.neg_inf, got.neg_inf);
  EXPECT_EQ(want.finite, got.finite);
  EXPECT_EQ(want.zeros, got.zeros);
  EXPECT_EQ(want.subnormal, got.subnormal);
  EXPECT_EQ(want.fp16_overflow, got.fp16_overflow);
  EXPECT_EQ(want.fp16_underflow, got.fp16_underflow);
  EXPECT_EQ(want.bf16_overflow, got.bf16_overflow);
  EXPECT_EQ(want.first_nonfinite_index, got.first_nonfinite_index);
  if (want.first_nonfinite_index >= 0) {
    if (std::isnan(want.first_nonfinite_value))
      EXPECT_TRUE(std::isnan(got.first_nonfinite_value));
    else
      EXPECT_EQ(want.first_nonfinite_value, got.first_nonfinite_value);
  }
  expect_close(want.min, got.min, 0, "min");
  expect_close(want.max, got.max, 0, "max");
  expect_close(want.absmax, got.absmax, 0, "absmax");
  expect_close(want.mean, got.mean, rel, "mean");
  expect_close(want.std, got.std, rel, "std");
  expect_close(want.l2_norm, got.l2_norm, rel, "l2_norm");
}

// Random normal data with NaN, +-Inf, zeros, subnormals and huge values
// planted at random positions (those the dtype can hold).
at::Tensor planted(int64_t n, at::ScalarType dtype, uint64_t seed) {
  at::manual_seed(seed);
  at::Tensor x = at::randn({n}, at::kDouble) * 3;
  std::mt19937_64 rng(seed);
  std::vector<double> specials = {kNaN, kInf, -kInf, 0.0, -0.0, 1e-5, -3e-7};
  if (dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16) {
    specials.push_back(1e-39);  // float32/bfloat16 subnormal
    specials.push_back(7e5);    // overflows float16
    specials.push_back(-1e37);
  }
  if (dtype == at::kDouble) {
    specials.push_back(1e-310);  // float64 subnormal
    specials.push_back(3.4e38);  // overflows bfloat16
  }
  if (dtype == at::kHalf) specials.push_back(3e-6);  // float16 subnormal
  double* d = x.data_ptr<double>();
  const int64_t plants = n == 0 ? 0 : 1 + n / 97;
  for (int64_t k = 0; k < plants; ++k) d[rng() % n] = specials[rng() % specials.size()];
  return x.to(dtype);
}

double tolerance(at::ScalarType t) { return t == at::kDouble ? 1e-10 : 2e-5; }

class census_dtypes : public ::testing::TestWithParam<at::ScalarType> {};

// Runs `check` once per instruction set the CPU has (AVX-512, AVX2, baseline).
template <typename F>
void for_each_isa(const F& check) {
  using nanguard::detail::kernel_isa;
  for (kernel_isa isa : {kernel_isa::baseline, kernel_isa::avx2, kernel_isa::avx512}) {
    nanguard::detail::force_isa(isa);
    if (nanguard::detail::active_isa() != isa) continue;  // not on this CPU
    SCOPED_TRACE(nanguard::detail::to_string(isa));
    check();
  }
  nanguard::detail::force_isa(kernel_isa::best);
}

TEST_P(census_dtypes, matches_reference_on_planted_data) {
  const at::ScalarType dtype = GetParam();
  for (int64_t n : {1, 7, 64, 1023, 1024, 1025, 4097, 70000, 300001}) {
    for (uint64_t seed : {1, 2}) {
      SCOPED_TRACE(::testing::Message() << "n=" << n << " seed=" << seed);
      const at::Tensor x = planted(n, dtype, seed);
      const tensor_stats want = reference(x);
      for_each_isa([&] {
        expect_matches(want, nanguard::census(x), tolerance(dtype));
        EXPECT_EQ(want.nonfinite() > 0, nanguard::has_nonfinite(x));
      });
      expect_matches(want, nanguard::detail::census_aten(x), tolerance(dtype));
    }
  }
}

TEST_P(census_dtypes, matches_reference_on_clean_data) {
  const at::ScalarType dtype = GetParam();
  at::manual_seed(7);
  const at::Tensor x = (at::randn({200003}, at::kDouble) * 1e-2 + 5).to(dtype);
  const tensor_stats s = nanguard::census(x);
  expect_matches(reference(x), s, tolerance(dtype));
  EXPECT_TRUE(s.all_finite());
  EXPECT_FALSE(nanguard::has_nonfinite(x));
}

TEST_P(census_dtypes, measures_views_in_logical_order) {
  const at::ScalarType dtype = GetParam();
  const at::Tensor base = planted(300 * 257, dtype, 3).reshape({300, 257});
  const std::vector<at::Tensor> views = {
      base.t(),                                        // transposed
      base.slice(1, 3, 250, 2),                        // strided slice
      base.select(1, 5),                               // column
      base.slice(0, 0, 1).expand({400, 257}),          // zero stride, repeated rows
      base.select(0, 9).unsqueeze(1).expand({257, 64}) // zero stride, repeated columns
  };
  for (size_t i = 0; i < views.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "view " << i);
    expect_matches(reference(views[i]), nanguard::census(views[i]), tolerance(dtype));
    EXPECT_EQ(reference(views[i]).nonfinite() > 0, nanguard::has_nonfinite(views[i]));
  }
}

TEST_P(census_dtypes, has_nonfinite_finds_a_single_value_anywhere) {
  const at::ScalarType dtype = GetParam();
  for (int64_t n : {1, 33, 4096, 200000}) {
    for (double bad : {kNaN, kInf, -kInf}) {
      for (int64_t at_index : {int64_t(0), n / 2, n - 1}) {
        at::Tensor x = at::randn({n}).to(dtype);
        for_each_isa([&] { EXPECT_FALSE(nanguard::has_nonfinite(x)); });
        x[at_index] = bad;
        for_each_isa([&] {
          EXPECT_TRUE(nanguard::has_nonfinite(x)) << "n=" << n << " at " << at_index << " " << bad;
          const tensor_stats s = nanguard::census(x);
          EXPECT_EQ(at_index, s.first_nonfinite_index);
          EXPECT_EQ(1, s.nonfinite());
        });
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(all, census_dtypes,
                         ::testing::Values(at::kFloat, at::kDouble, at::kHalf, at::kBFloat16),
                         [](const auto& info) { return std::string(c10::toString(info.param)); });

TEST(census, empty_tensor_has_no_statistics) {
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    const at::Tensor x = at::empty({0, 3}, dtype);
    const tensor_stats s = nanguard::census(x);
    EXPECT_EQ(0, s.numel);
    EXPECT_EQ(0, s.finite);
    EXPECT_TRUE(s.all_finite());
    EXPECT_TRUE(std::isnan(s.mean));
    EXPECT_EQ(-1, s.first_nonfinite_index);
    EXPECT_FALSE(nanguard::has_nonfinite(x));
    expect_matches(s, nanguard::detail::census_aten(x), 0);
  }
}

TEST(census, all_nonfinite_tensor_has_no_finite_statistics) {
  const at::Tensor x = at::full({5000}, kNaN);
  const tensor_stats s = nanguard::census(x);
  EXPECT_EQ(5000, s.nan);
  EXPECT_EQ(0, s.finite);
  EXPECT_TRUE(std::isnan(s.min));
  EXPECT_EQ(0, s.l2_norm);
  EXPECT_EQ(0, s.first_nonfinite_index);
}

TEST(census, mean_and_std_of_1e8_elements_stay_accurate) {
  // 1e8 floats cycling through 1000 values near 1000: naive float sums lose
  // about 3 digits here. The exact answer comes from the 1000 distinct values.
  constexpr int64_t kPeriod = 1000, kN = 100'000'000;
  const at::Tensor period = 1000.0f + (at::arange(kPeriod, at::kFloat) - 499.5f) / 1000.0f;
  const at::Tensor x = period.repeat({kN / kPeriod});
  const tensor_stats want = reference(period);
  const tensor_stats got = nanguard::census(x);
  EXPECT_EQ(kN, got.finite);
  EXPECT_NEAR(want.mean, got.mean, 1e-9 * want.mean);
  EXPECT_NEAR(want.std, got.std, 1e-6 * want.std);
  EXPECT_NEAR(want.l2_norm * std::sqrt(double(kN / kPeriod)), got.l2_norm, 1e-9 * got.l2_norm);
}

// Centred within two standard deviations: summed without a shift.
TEST(census, std_stays_accurate_for_data_just_inside_the_unshifted_range) {
  at::manual_seed(4);
  const at::Tensor x = (at::randn({1 << 20}, at::kDouble) + 1.9).to(at::kFloat);
  expect_matches(reference(x), nanguard::census(x), 2e-5);
}

// Gradient-like data: about half of it below float16's smallest normal, so
// every sub-block holds tiny values; zeros only in some, subnormals in one.
TEST(census, counts_tiny_values_with_and_without_zeros_nearby) {
  at::manual_seed(5);
  at::Tensor x = at::randn({100000}) * 1e-4;
  x.narrow(0, 50000, 20000).relu_();
  x[80001] = 1e-39f;
  x[90000] = -0.0f;
  const tensor_stats want = reference(x);
  ASSERT_GT(want.zeros, 9000);
  ASSERT_GT(want.fp16_underflow, 40000);
  ASSERT_EQ(1, want.subnormal);
  for_each_isa([&] { expect_matches(want, nanguard::census(x), 2e-5); });
}

TEST(census, huge_finite_values_do_not_overflow_the_sums) {
  at::Tensor x = at::full({4096}, 3e38f);
  x[1] = -3.3e38f;
  expect_matches(reference(x), nanguard::census(x), 1e-6);
}

// Float64 values whose sums or squares overflow where the statistics do
// not: those stay finite and right (std is the population's, ddof = 0).
TEST(census, float64_moments_stay_finite_where_their_sums_overflow) {
  const auto census_of = [](std::vector<double> v) { return nanguard::census(at::tensor(v, at::kDouble)); };
  expect_close(std::sqrt(2.0) * 1e200, census_of({1e200, 1e200}).l2_norm, 1e-15, "l2 of [1e200, 1e200]");
  const tensor_stats opposite = census_of({1e308, -1e308});
  EXPECT_EQ(0.0, opposite.mean);
  expect_close(1e308, opposite.std, 1e-15, "std of [1e308, -1e308]");
  expect_close(std::sqrt(2.0) * 1e308, opposite.l2_norm, 1e-15, "l2 of [1e308, -1e308]");
  const tensor_stats top = census_of({1.7e308, 1.7e308});
  EXPECT_EQ(1.7e308, top.mean);
  EXPECT_EQ(0.0, top.std);
  EXPECT_EQ(kInf, top.l2_norm) << "2.4e308 is beyond float64";
  // The sum of squares overflows and the sum does not (the variance was clamped to 0).
  expect_close(std::sqrt(2.0) / 3 * 1e160, census_of({0, 1e160, 1e160}).std, 1e-15, "std of [0, 1e160, 1e160]");
  // Across blocks and threads, beside NaN and Inf, on every instruction set, and a negative view.
  at::manual_seed(9);
  at::Tensor x = at::randn({300001}, at::kDouble) * 1e303;  // l2 ~ 5e305
  x[17] = kNaN;
  x[200000] = -kInf;
  for_each_isa([&] { expect_matches(reference(x), nanguard::census(x), 1e-12); });
  expect_matches(reference(x.neg()), nanguard::census(at::_neg_view(x)), 1e-12);
}

// Values within float32 ulps of where a cast to float16 or bfloat16 turns
// them into Inf, of both signs: the census counts what torch's cast makes Inf.
at::Tensor around_the_overflow_thresholds(int64_t n) {
  at::manual_seed(10);
  const auto steps = [&](double centre, double ulp) {  // float32 values and the midpoints between them
    return centre + at::randint(-64, 65, {n}, at::kDouble) * (ulp / 2);
  };
  const auto band = [&](double lo, double hi) { return lo + at::rand({n}, at::kDouble) * (hi - lo); };
  const at::Tensor exact = at::tensor({65504.0, 65519.99609375, 65519.998046875, 65520.0, 65536.0,
                                       3.3895313892515355e38, 3.3961775292304459e38, 3.4028234663852886e38},
                                      at::kDouble);
  const at::Tensor values = at::cat({steps(65520, std::ldexp(1.0, -8)), band(65490, 65540),
                                     steps(3.3961775292304459e38, std::ldexp(1.0, 104)),
                                     band(3.389e38, 3.41e38), exact, at::randn({n}, at::kDouble)});
  return values * (at::randint(0, 2, values.sizes(), at::kDouble) * 2 - 1);
}

TEST(census, overflow_counts_are_the_values_a_cast_turns_into_inf) {
  const at::Tensor wide = around_the_overflow_thresholds(20000);
  for (const auto dtype : {at::kDouble, at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const bool with_nan : {false, true}) {  // a NaN sends its block to the exact scalar path
      SCOPED_TRACE(::testing::Message() << dtype << (with_nan ? " with a NaN" : ""));
      at::Tensor x = wide.to(dtype);
      if (with_nan) x[5] = kNaN;
      const auto infs_once_cast_to = [&](at::ScalarType t) {
        return (x.isfinite() & x.to(t).isinf()).sum().item<int64_t>();
      };
      const int64_t fp16 = infs_once_cast_to(at::kHalf), bf16 = infs_once_cast_to(at::kBFloat16);
      if (dtype == at::kDouble || dtype == at::kFloat) {  // the data holds both kinds on both sides
        const auto beyond = [&](double max) { return ((x.abs() > max) & x.isfinite()).sum().item<int64_t>(); };
        ASSERT_GT(bf16, 5000);
        ASSERT_GT(beyond(65504), fp16 + 1000) << "values that round down to 65504";
        ASSERT_GT(beyond(3.3895313892515355e38), bf16 + 1000) << "values that round down to bfloat16's largest";
      }
      for_each_isa([&] {
        const tensor_stats s = nanguard::census(x);
        EXPECT_EQ(fp16, s.fp16_overflow);
        EXPECT_EQ(bf16, s.bf16_overflow);
      });
      const tensor_stats by_aten = nanguard::detail::census_aten(x);
      EXPECT_EQ(fp16, by_aten.fp16_overflow);
      EXPECT_EQ(bf16, by_aten.bf16_overflow);
    }
  }
}

// A wrong dtype is a c10::TypeError (Python: TypeError).
TEST(census, rejects_integer_tensors_with_a_clear_message) {
  try {
    nanguard::census(at::arange(10));
    FAIL() << "census of an integer tensor must throw";
  } catch (const c10::TypeError& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(std::string::npos, msg.find("nanguard::census: expected a float32, float64, "
                                          "float16 or bfloat16 tensor but got Long"))
        << msg;
    EXPECT_NE(std::string::npos, msg.find("x.to(at::kFloat)")) << msg;
  }
  EXPECT_THROW(nanguard::census(at::ones({2}, at::kBool)), c10::TypeError);
  EXPECT_THROW(nanguard::census(at::ones({2}, at::kComplexFloat)), c10::TypeError);
}

// The message's fix in the process's language: C++ unless the Python
// module chose Python (nanguard::spelling).
TEST(census, names_the_fix_in_the_language_set_for_the_process) {
  const auto message = [] {
    try {
      nanguard::census(at::arange(10));
    } catch (const c10::TypeError& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  ASSERT_EQ(nanguard::message_spelling(), nanguard::spelling::cpp);
  EXPECT_NE(std::string::npos, message().find("(convert with x.to(at::kFloat) to measure them anyway)")) << message();
  nanguard::set_message_spelling(nanguard::spelling::python);
  const std::string python = message();
  nanguard::set_message_spelling(nanguard::spelling::cpp);
  EXPECT_NE(std::string::npos, python.find("(convert with x.float() to measure them anyway)")) << python;
  EXPECT_EQ(std::string::npos, python.find("at::")) << python;
}

TEST(census, rejects_undefined_tensors) {
  try {
    nanguard::census(at::Tensor());
    FAIL() << "census of an undefined tensor must throw";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what_without_backtrace()).find("undefined"));
  }
  EXPECT_THROW(nanguard::has_nonfinite(at::Tensor()), c10::Error);
}

TEST(has_nonfinite, integer_and_bool_tensors_are_finite) {
  EXPECT_FALSE(nanguard::has_nonfinite(at::arange(100)));
  EXPECT_FALSE(nanguard::has_nonfinite(at::ones({3}, at::kBool)));
  EXPECT_FALSE(nanguard::has_nonfinite(at::ones({3}, at::kByte)));
}

TEST(has_nonfinite, the_one_thread_scan_agrees_on_every_dtype_and_size) {
  using nanguard::detail::has_nonfinite_on_this_thread;
  for (const auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16})
    for (const int64_t n : {int64_t(1), int64_t(1000), (int64_t(1) << 21) + 3}) {  // past the parallel chunk
      at::Tensor x = at::randn({n}).to(dtype);
      EXPECT_FALSE(has_nonfinite_on_this_thread(x)) << dtype << " " << n;
      x[n - 1] = kInf;  // the last element: every chunk is read
      EXPECT_TRUE(has_nonfinite_on_this_thread(x)) << dtype << " " << n;
      EXPECT_TRUE(has_nonfinite_on_this_thread(x.flip(0))) << "a strided view";
    }
  EXPECT_FALSE(has_nonfinite_on_this_thread(at::arange(10)));
  EXPECT_THROW(has_nonfinite_on_this_thread(at::Tensor()), c10::Error);
}

// The range scan's bounds hold every value, and are the exact min and max
// when the values take both signs (one sign alone bounds the other side by 0).
TEST(value_range, bounds_every_dtype_sign_and_special_value_on_every_isa) {
  using nanguard::detail::value_range_on_this_thread;
  for_each_isa([] {
    for (const auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16})
      for (const int64_t n : {int64_t(1), int64_t(31), int64_t(1000), int64_t(70001)}) {
        SCOPED_TRACE(::testing::Message() << dtype << " n=" << n);
        const at::Tensor mixed = (at::randn({n}) * 3).to(dtype);
        const auto r = value_range_on_this_thread(mixed);
        const auto [lo, hi] = at::aminmax(mixed.to(at::kDouble));
        if (n > 1) {
          EXPECT_EQ(lo.item<double>(), r.lo);
          EXPECT_EQ(hi.item<double>(), r.hi);
        }
        EXPECT_LE(r.lo, lo.item<double>());
        EXPECT_GE(r.hi, hi.item<double>());
        const auto negative = value_range_on_this_thread(-mixed.abs() - 1);
        EXPECT_EQ(0.0, negative.hi);
        EXPECT_EQ((-mixed.abs() - 1).min().item<double>(), negative.lo);
        const auto positive = value_range_on_this_thread(mixed.abs() + 1);
        EXPECT_EQ(0.0, positive.lo);
        EXPECT_EQ((mixed.abs() + 1).max().item<double>(), positive.hi);
        for (const double special : {double(NAN), -double(NAN), kInf, -kInf}) {
          at::Tensor x = mixed.clone();
          x[n / 2] = special;
          const auto s = value_range_on_this_thread(x);
          EXPECT_FALSE(s.finite()) << special;
          if (std::isnan(special)) EXPECT_TRUE(std::isnan(s.lo) && std::isnan(s.hi));
          else EXPECT_EQ(special, special > 0 ? s.hi : s.lo);
        }
      }
  });
  EXPECT_EQ(4.0, value_range_on_this_thread(at::arange(5.0).flip(0).expand({3, 5})).hi) << "a strided view";
  // Dense views are read in memory order, without a copy: the range is the same.
  at::Tensor block = at::randn({6, 7, 8});
  for (const at::Tensor& view : {block.permute({2, 0, 1}), block.transpose(0, 2), block.select(0, 3).t()}) {
    const auto r = value_range_on_this_thread(view);
    EXPECT_EQ(view.min().item<double>(), r.lo);
    EXPECT_EQ(view.max().item<double>(), r.hi);
  }
  block[5][6][7] = kInf;
  EXPECT_FALSE(value_range_on_this_thread(block.permute({2, 0, 1})).finite()) << "its last element in memory";
  EXPECT_TRUE(value_range_on_this_thread(block.slice(0, 0, 5).transpose(1, 2)).finite()) << "only what it views";
  const auto empty = value_range_on_this_thread(at::empty({0}));
  EXPECT_TRUE(empty.finite());
}

TEST(census, renders_one_readable_line) {
  at::Tensor x = at::ones({4});
  x[2] = -kInf;
  const std::string line = nanguard::to_string(nanguard::census(x));
  EXPECT_NE(std::string::npos, line.find("n=4 nan=0 +inf=0 -inf=1")) << line;
  EXPECT_NE(std::string::npos, line.find("first_nonfinite[2]=-inf")) << line;
}

}  // namespace

TEST(merge_census, the_census_of_shards_is_the_census_of_the_whole) {
  const at::Tensor x = planted(1000, at::kFloat, 7);
  std::vector<tensor_stats> parts;
  // Uneven shards, one of them empty; a shard's index counts from the whole's start.
  const std::vector<int64_t> bounds = {0, 130, 130, 611, 1000};
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    tensor_stats s = nanguard::census(x.narrow(0, bounds[i], bounds[i + 1] - bounds[i]));
    if (s.first_nonfinite_index >= 0) s.first_nonfinite_index += bounds[i];
    parts.push_back(s);
  }
  expect_matches(reference(x), nanguard::merge_census(parts), 1e-5);
}

TEST(merge_census, float64_shards_beyond_1e154_keep_finite_moments) {
  // Their squares (and the count-weighted sum of their means) pass float64's
  // range; the whole's L2 norm, mean and std do not.
  const at::Tensor x = at::linspace(1.0, 3.0, 1000, at::kDouble) * 1e300;
  std::vector<tensor_stats> parts;
  const std::vector<int64_t> bounds = {0, 250, 600, 1000};
  for (size_t i = 0; i + 1 < bounds.size(); ++i)
    parts.push_back(nanguard::census(x.narrow(0, bounds[i], bounds[i + 1] - bounds[i])));
  const tensor_stats whole = nanguard::census(x);
  const tensor_stats m = nanguard::merge_census(parts);
  ASSERT_TRUE(std::isfinite(whole.l2_norm) && std::isfinite(whole.std));
  EXPECT_NEAR(whole.l2_norm, m.l2_norm, 1e-12 * whole.l2_norm);
  EXPECT_NEAR(whole.mean, m.mean, 1e-12 * whole.mean);
  EXPECT_NEAR(whole.std, m.std, 1e-9 * whole.std);
}

TEST(merge_census, shards_without_finite_values_leave_min_max_and_mean_to_the_others) {
  const at::Tensor nan = at::full({3}, kNaN);
  const at::Tensor x = at::tensor({-2.0f, 5.0f});
  tensor_stats s = nanguard::census(x);
  s.first_nonfinite_index = -1;
  const tensor_stats m = nanguard::merge_census({nanguard::census(nan), s});
  expect_matches(reference(at::cat({nan, x})), m, 1e-6);
  EXPECT_EQ(nanguard::merge_census({}).numel, 0);
  EXPECT_TRUE(std::isnan(nanguard::merge_census({}).mean));
}
