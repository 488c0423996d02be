#include "nanguard/fpe.h"
#include "nanguard/scope.h"

#include <gtest/gtest.h>
#include <ATen/ATen.h>

#include <cfenv>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <tuple>

// "Custom C++ code": exported (the test links with -rdynamic) and not
// inlined, so the trap's report can name it.
extern "C" __attribute__((noipa)) double nanguard_test_divide(double a, double b) { return a / b; }
extern "C" __attribute__((noipa)) double nanguard_test_scale(double a, double b) { return a * b; }

namespace {

volatile double zero = 0.0;  // volatile: the divisions happen at run time

TEST(fpe_trap_death, division_by_zero_in_custom_code_stops_with_its_location) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        nanguard::fpe_trap trap;
        NANGUARD_SCOPE("custom.div");
        nanguard::fpe_trap::note_scope();
        const double r = nanguard_test_divide(1.0, zero);
        std::fprintf(stderr, "not trapped: %g\n", r);
        std::_Exit(0);
      },
      ::testing::KilledBySignal(SIGFPE),
      "nanguard: SIGFPE: floating-point divide by zero \\(FE_DIVBYZERO\\) at 0x[0-9a-f]+.*"
      "in scope 'custom.div'.*backtrace.*nanguard_test_divide.*stopping the process");
}

TEST(fpe_trap_death, without_a_trap_division_by_zero_is_quiet) {
  EXPECT_TRUE(std::isinf(nanguard_test_divide(1.0, zero)));
  EXPECT_EQ(0, fegetexcept());
}

TEST(fpe_trap, run_turns_a_division_by_zero_into_fpe_error) {
  NANGUARD_SCOPE("custom.ratio");
  try {
    nanguard::fpe_trap::run([] { return nanguard_test_divide(1.0, zero); });
    FAIL() << "expected nanguard::fpe_error";
  } catch (const nanguard::fpe_error& e) {
    const auto& f = e.fault();
    EXPECT_EQ(FPE_FLTDIV, f.code);
    EXPECT_NE(0u, f.address);
    EXPECT_EQ(0u, f.symbol.find("nanguard_test_divide+0x")) << f.symbol;
    EXPECT_EQ("custom.ratio", f.scope);
    EXPECT_FALSE(f.backtrace.empty());
    const std::string what = e.what();
    EXPECT_NE(std::string::npos, what.find("floating-point divide by zero (FE_DIVBYZERO) at 0x")) << what;
    EXPECT_NE(std::string::npos, what.find("in nanguard_test_divide+0x")) << what;
    EXPECT_NE(std::string::npos, what.find("scope 'custom.ratio'")) << what;
    // A c10::Error, as every nanguard error: the report without LibTorch's backtrace of the throw.
    const c10::Error& as_c10 = e;
    EXPECT_EQ(0u, std::string(as_c10.what_without_backtrace()).find("nanguard: SIGFPE: floating-point divide by zero"));
  }
  // Disarmed again, with the environment as before: quiet Inf, no traps left.
  EXPECT_EQ(0, fegetexcept());
  EXPECT_TRUE(std::isinf(nanguard_test_divide(1.0, zero)));
  // And it can trap again.
  EXPECT_THROW(nanguard::fpe_trap::run([] { return nanguard_test_divide(-1.0, zero); }), nanguard::fpe_error);
}

TEST(fpe_trap, run_traps_invalid_and_overflow_and_returns_values) {
  try {
    nanguard::fpe_trap::run([] { return nanguard_test_divide(zero, zero); });
    FAIL() << "0/0 should trap";
  } catch (const nanguard::fpe_error& e) {
    EXPECT_EQ(FPE_FLTINV, e.fault().code);
    EXPECT_NE(std::string::npos, std::string(e.what()).find("FE_INVALID")) << e.what();
  }
  try {
    nanguard::fpe_trap::run([] { return nanguard_test_scale(1e308, 10.0 + zero); });
    FAIL() << "1e308 * 10 should trap";
  } catch (const nanguard::fpe_error& e) {
    EXPECT_EQ(FPE_FLTOVF, e.fault().code);
  }
  EXPECT_EQ(0.5, nanguard::fpe_trap::run([] { return nanguard_test_divide(1.0, 2.0 + zero); }));
}

TEST(fpe_trap, options_choose_the_exceptions_and_the_mask_is_restored) {
  {
    nanguard::fpe_trap trap(nanguard::fpe_options().divbyzero(false));
    EXPECT_EQ(FE_INVALID | FE_OVERFLOW, fegetexcept());
    EXPECT_TRUE(std::isinf(nanguard_test_divide(1.0, zero)));  // not trapped
    {
      nanguard::fpe_trap inner;
      EXPECT_EQ(FE_INVALID | FE_OVERFLOW | FE_DIVBYZERO, fegetexcept());
    }
    EXPECT_EQ(FE_INVALID | FE_OVERFLOW, fegetexcept());
  }
  EXPECT_EQ(0, fegetexcept());
}

TEST(guard_op, names_the_op_that_made_a_nonfinite_value) {
  NANGUARD_SCOPE("features");
  const at::Tensor x = at::tensor({1.0f, 0.0f, 4.0f});
  try {
    nanguard::guard_op("my_ops::inverse", [](const at::Tensor& t) { return 1.0 / t; }, x);
    FAIL() << "expected nonfinite_error";
  } catch (const nanguard::nonfinite_error& e) {
    const auto& f = e.finding();
    EXPECT_EQ("my_ops::inverse", f.op);
    EXPECT_EQ("features", f.module);
    EXPECT_EQ(nanguard::role::producer, f.role);
    EXPECT_EQ(1, f.index);
    EXPECT_TRUE(std::isinf(f.value));
    ASSERT_EQ(1u, f.inputs.size());
    ASSERT_EQ(1u, f.outputs.size());
    EXPECT_EQ(1, f.outputs[0].stats.pos_inf);
    EXPECT_NE(std::string::npos, std::string(e.what()).find("forward my_ops::inverse in features: producer"))
        << e.what();
  }
}

TEST(guard_op, names_the_bad_argument_and_passes_good_results_through) {
  const at::Tensor bad = at::tensor({1.0f, NAN});
  const at::Tensor ok = at::ones({2});
  try {
    nanguard::guard_op("my_ops::add", [](const at::Tensor& a, const at::Tensor& b) { return a + b; }, ok, bad);
    FAIL() << "expected nonfinite_error";
  } catch (const nanguard::nonfinite_error& e) {
    EXPECT_EQ("my_ops::add", e.finding().op);
    EXPECT_EQ(nanguard::role::input, e.finding().role);
    EXPECT_EQ("input 1", e.finding().culprit);
    EXPECT_EQ(1, e.finding().index);
  }
  // Tuples of tensors are checked element by element; non-tensors pass.
  const auto [s, n] = nanguard::guard_op(
      "my_ops::split", [](const at::Tensor& t, int k) { return std::make_tuple(t * k, k); }, ok, 3);
  EXPECT_EQ(3.0f, s[0].item<float>());
  EXPECT_EQ(3, n);
  try {
    nanguard::guard_op("my_ops::pair", [](const at::Tensor& t) { return std::make_tuple(t, t.log() - 1e39); }, ok);
    FAIL() << "expected nonfinite_error";
  } catch (const nanguard::nonfinite_error& e) {
    EXPECT_EQ(1, e.finding().output);
    EXPECT_EQ(2u, e.finding().outputs.size());
  }
}

// guard_op tells a trap which op is running: the report names it.
TEST(guard_op, an_fpe_trap_inside_names_the_op) {
  NANGUARD_SCOPE("loader");
  try {
    nanguard::fpe_trap::run([] {
      return nanguard::guard_op("my_ops::ratio", [](const at::Tensor& t) {
        return t * nanguard_test_divide(1.0, zero);
      }, at::ones({2}));
    });
    FAIL() << "expected nanguard::fpe_error";
  } catch (const nanguard::fpe_error& e) {
    EXPECT_EQ("my_ops::ratio in loader", e.fault().scope);
  }
}

}  // namespace
