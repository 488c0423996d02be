// validators.h — option checks that CLI11 2.1 does not make: it reads "-1"
// into an unsigned option as 2^64 - 1, an integer past its type's range as
// the largest value, and CLI::Range lets "nan" through.
// A value they refuse stops the parse with "--opt: what it must be, got X"
// (exit code 2).
//
//   sub->add_option("--seed", a->seed, "...")->check(non_negative_integer());
//   sub->add_option("--steps", a->steps, "...")->check(integer_in(1, max_steps));
//   sub->add_option("--low-quantile", a->low, "...")->check(finite_in(0, 1));
#pragma once

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

namespace nanguard::cli {

/// An integer in [lo, hi] of type T, written in decimal.
template <class T>
CLI::Validator integer_in(T lo, T hi) {
  const std::string range = fmt::format("in [{}, {}]", lo, hi);
  return CLI::Validator(
      [lo, hi, range](const std::string& s) {
        T v = 0;
        const auto [end, error] = std::from_chars(s.data(), s.data() + s.size(), v);
        const bool ok = error == std::errc() && end == s.data() + s.size() && v >= lo && v <= hi;
        return ok ? std::string() : fmt::format("must be an integer {}, got {}", range, s);
      },
      range);
}

/// An integer >= 0 that fits 64 bits, for an unsigned option such as a seed.
inline CLI::Validator non_negative_integer() {
  return integer_in<uint64_t>(0, std::numeric_limits<uint64_t>::max());
}

/// The most steps a command runs: years of training, not a typo's 10^20.
inline constexpr int64_t max_steps = 1'000'000'000;

/// A finite number in [lo, hi]; `hi` may be infinity (no upper bound).
inline CLI::Validator finite_in(double lo, double hi) {
  const std::string range = std::isinf(hi) ? fmt::format(">= {}", lo) : fmt::format("in [{}, {}]", lo, hi);
  return CLI::Validator(
      [lo, hi, range](const std::string& s) {
        double v = 0;
        const bool ok = CLI::detail::lexical_cast(s, v) && std::isfinite(v) && v >= lo && v <= hi;
        return ok ? std::string() : fmt::format("must be a finite number {}, got {}", range, s);
      },
      range);
}

}  // namespace nanguard::cli
