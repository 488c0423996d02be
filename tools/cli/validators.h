// validators.h — option checks that CLI11 2.1 does not make: it reads "-1"
// into an unsigned option as 2^64 - 1, and CLI::Range lets "nan" through.
// A value they refuse stops the parse with "--opt: what it must be, got X"
// (exit code 2).
//
//   sub->add_option("--seed", a->seed, "...")->check(non_negative_integer());
//   sub->add_option("--low-quantile", a->low, "...")->check(finite_in(0, 1));
#pragma once

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cmath>
#include <string>

namespace nanguard::cli {

/// An integer >= 0, for an unsigned option such as a seed.
inline CLI::Validator non_negative_integer() {
  return CLI::Validator(
      [](const std::string& s) {
        return s.find('-') == std::string::npos ? std::string()
                                                : fmt::format("must be an integer >= 0, got {}", s);
      },
      "NONNEGATIVE");
}

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
