// short_decimal.h — the exact fast path for the short decimal numbers that
// fill numeric CSV files (0.1257302, -1.265421e-05, 42).
#pragma once

#include <cstdint>
#include <cstring>

namespace nanguard::detail {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "short_decimal.h reads 8 digits as a little-endian word");

/// Bytes that must be readable past the end mark of the text parse_short_decimal reads.
constexpr int64_t kShortDecimalPadding = 8;

/// How many of the 8 bytes at `p` are digits before the first one that is
/// not (0 to 8), and in `value` the number they write. Branch-free (the
/// SWAR form of fast_float's parse_eight_digits_unrolled): the length of a
/// run of digits changes from cell to cell, and a loop's mispredicted exit
/// cost more than the digits.
inline int leading_digits(const char* p, uint64_t& value) {
  uint64_t word;
  std::memcpy(&word, p, sizeof word);
  const uint64_t digits = word - 0x3030303030303030u;  // '0' is 0x30; a borrow only reaches later bytes
  // A byte's top bit: below '0' (its digit wrapped), above '9' (+0x46 carries past 0x7f), or >= 0x80.
  const uint64_t not_digit = ((word + 0x4646464646464646u) | digits) & 0x8080808080808080u;
  const int n = not_digit ? __builtin_ctzll(not_digit) / 8 : 8;
  // The n digits to the top bytes, zeros (leading zeros) below, then the
  // pairs, fours and eights of digits combined by three multiplications.
  uint64_t v = n == 0 ? 0 : digits << (64 - 8 * n);
  v = v * 10 + (v >> 8);
  v = ((v & 0x000000FF000000FFu) * (100 + (1000000ull << 32)) +
       ((v >> 16) & 0x000000FF000000FFu) * (1 + (10000ull << 32))) >> 32;
  value = v;
  return n;
}

/// Parses `-`? digits (`.` digits)? ((`e`|`E`) (`+`|`-`)? digits)? at `p`
/// into `v` and returns one past its last character, when the number is
/// short: at most 19 digits, read as an integer m times 10^k with m <= 2^53
/// and |k| <= 22. Returns nullptr for anything else (more digits, a larger
/// exponent, a leading '+', inf, nan, no digit at all): the caller then
/// parses the text with std::from_chars.
///
/// Exact (Clinger's fast path): m and 10^|k| are both doubles exactly, so
/// the one multiplication or division rounds the true value correctly and
/// gives the very double std::from_chars gives ("-0" gives -0.0). About a
/// third of from_chars' instructions for such a number: it skips the
/// general parser's checks, reads 8 digits at a time and is inlined into
/// the caller's loop.
///
/// REQUIRES: a character that is not part of a number (a delimiter, a
/// '\n') ends the text, and kShortDecimalPadding bytes past that end mark
/// are readable (their values do not matter).
/// NOTE: exact under the default rounding mode, round to nearest.
inline const char* parse_short_decimal(const char* p, double& v) {
  static constexpr double kPowersOfTen[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                            1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                            1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};
  static constexpr uint64_t kScales[] = {1, 10, 100, 1000, 10000, 100000, 1000000, 10000000, 100000000};
  constexpr int64_t kMaxExactPower = 22;  // 10^22 = 2^22 * 5^22, 5^22 < 2^53: a double exactly
  constexpr uint64_t kMaxExactMantissa = uint64_t(1) << 53;
  constexpr int64_t kMaxDigits = 19;      // 10^19 - 1 fits a uint64_t
  // Appends a run of digits to the mantissa, 8 at a time; past 19 digits the
  // mantissa wraps, but such a number is refused below.
  uint64_t mantissa = 0;
  int64_t digits = 0;
  const auto append_digits = [&](const char* q) {
    int n;
    do {
      uint64_t value;
      n = leading_digits(q, value);
      mantissa = mantissa * kScales[n] + value;
      q += n;
      digits += n;
    } while (n == 8 && digits <= kMaxDigits);
    return q;
  };

  const bool negative = *p == '-';
  p = append_digits(p + negative);
  int64_t exponent = 0;
  if (*p == '.') {
    const int64_t integer_digits = digits;
    p = append_digits(p + 1);
    exponent = integer_digits - digits;
  }
  if (digits == 0 || digits > kMaxDigits) return nullptr;
  if (*p == 'e' || *p == 'E') {
    ++p;
    const bool negative_exponent = *p == '-';
    p += *p == '-' || *p == '+';
    uint64_t written;
    const int n = leading_digits(p, written);
    if (n == 0 || n > 4) return nullptr;  // "1e", or an exponent of 5 digits or more
    p += n;
    exponent += negative_exponent ? -int64_t(written) : int64_t(written);
  }
  if (mantissa > kMaxExactMantissa || exponent < -kMaxExactPower || exponent > kMaxExactPower) return nullptr;
  const double m = double(mantissa);
  const double magnitude = exponent < 0 ? m / kPowersOfTen[-exponent] : m * kPowersOfTen[exponent];
  v = negative ? -magnitude : magnitude;
  return p;
}

}  // namespace nanguard::detail
