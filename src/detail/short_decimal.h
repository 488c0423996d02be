// short_decimal.h — the exact fast path for the short decimal numbers that
// fill numeric CSV files (0.1257302, -1.265421e-05, 42).
#pragma once

#include <cstdint>

namespace nanguard::detail {

/// Parses `-`? digits (`.` digits)? ((`e`|`E`) (`+`|`-`)? digits)? at `p`
/// into `v` and returns one past its last character, when the number is
/// short: at most 19 digits, read as an integer m times 10^k with m <= 2^53
/// and |k| <= 22. Returns nullptr for anything else (more digits, a larger
/// exponent, a leading '+', inf, nan, no digit at all): the caller then
/// parses the text with std::from_chars.
///
/// Exact (Clinger's fast path): m and 10^|k| are both doubles exactly, so
/// the one multiplication or division rounds the true value correctly and
/// gives the very double std::from_chars gives ("-0" gives -0.0). About
/// half of from_chars' instructions for such a number: it skips the
/// general parser's checks and is inlined into the caller's loop.
///
/// REQUIRES: a character that is not part of a number (a delimiter, a
/// '\n') ends the text before the buffer ends: nothing past it is read.
/// NOTE: exact under the default rounding mode, round to nearest.
inline const char* parse_short_decimal(const char* p, double& v) {
  static constexpr double kPowersOfTen[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                            1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                            1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};
  constexpr int64_t kMaxExactPower = 22;  // 10^22 = 2^22 * 5^22, 5^22 < 2^53: a double exactly
  constexpr uint64_t kMaxExactMantissa = uint64_t(1) << 53;
  constexpr int64_t kMaxDigits = 19;      // 10^19 - 1 fits a uint64_t
  const auto is_digit = [](char c) { return static_cast<unsigned char>(c - '0') < 10; };

  const bool negative = *p == '-';
  p += negative;
  uint64_t mantissa = 0;
  const char* const integer = p;
  while (is_digit(*p)) mantissa = mantissa * 10 + uint64_t(*p++ - '0');
  int64_t digits = p - integer;
  int64_t exponent = 0;
  if (*p == '.') {
    const char* const fraction = ++p;
    while (is_digit(*p)) mantissa = mantissa * 10 + uint64_t(*p++ - '0');
    exponent = -(p - fraction);
    digits += p - fraction;
  }
  if (digits == 0 || digits > kMaxDigits) return nullptr;
  if (*p == 'e' || *p == 'E') {
    ++p;
    const bool negative_exponent = *p == '-';
    p += *p == '-' || *p == '+';
    const char* const first = p;
    int64_t written = 0;
    while (is_digit(*p) && p - first < 4) written = written * 10 + (*p++ - '0');
    if (p == first || is_digit(*p)) return nullptr;  // "1e" or an exponent of 5 digits or more
    exponent += negative_exponent ? -written : written;
  }
  if (mantissa > kMaxExactMantissa || exponent < -kMaxExactPower || exponent > kMaxExactPower) return nullptr;
  const double m = double(mantissa);
  const double magnitude = exponent < 0 ? m / kPowersOfTen[-exponent] : m * kPowersOfTen[exponent];
  v = negative ? -magnitude : magnitude;
  return p;
}

}  // namespace nanguard::detail
