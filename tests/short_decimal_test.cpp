#include "detail/short_decimal.h"

#include <gtest/gtest.h>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

namespace {

using nanguard::detail::parse_short_decimal;

// The bits of a double: -0.0 and 0.0 differ, as do two NaNs.
uint64_t bits(double v) {
  uint64_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

// `text`, a delimiter, and the padding parse_short_decimal may read.
std::string cell_of(const std::string& text) {
  return text + "," + std::string(size_t(nanguard::detail::kShortDecimalPadding), '7');
}

// Whether parse_short_decimal takes `text` (ended by a delimiter, as in a
// CSV line); when it does, it must stop where std::from_chars stops and
// give its double bit for bit, and strtod's too.
bool taken_exactly(const std::string& text) {
  const std::string cell = cell_of(text);
  double fast = 0;
  const char* const end = parse_short_decimal(cell.data(), fast);
  if (end == nullptr) return false;
  double reference = 0;
  const auto r = std::from_chars(cell.data(), cell.data() + text.size() + 1, reference);
  EXPECT_EQ(r.ec, std::errc()) << text;
  EXPECT_EQ(end, r.ptr) << text;
  EXPECT_EQ(bits(fast), bits(reference)) << text;
  EXPECT_EQ(bits(fast), bits(std::strtod(std::string(cell.data(), end).c_str(), nullptr))) << text;
  return true;
}

TEST(short_decimal, takes_short_numbers_as_from_chars_reads_them) {
  for (const char* text : {"0", "-0", "0.0", "-0.0", "-0e5", "1", "1.", ".5", "-.5", "00.5", "0.1257302",
                           "-1.265421e-05", "3.4028235E+20", "5e+3", "5E3", "-5e-0", "1e0000", "1.e5",
                           "123.456e-2", "0.25e-0003", "12345678", "0.04132598", "1234567.812345678",
                           "00000000000000001.5"}) {
    EXPECT_TRUE(taken_exactly(text)) << text;
  }
}

TEST(short_decimal, takes_numbers_right_at_its_limits) {
  EXPECT_TRUE(taken_exactly("9007199254740992"));      // 2^53
  EXPECT_TRUE(taken_exactly("9007199254740.992"));     // 2^53 as the mantissa of 10^-3
  EXPECT_TRUE(taken_exactly("1e22"));                  // the largest exact power of ten
  EXPECT_TRUE(taken_exactly("1e-22"));
  EXPECT_TRUE(taken_exactly("9007199254740992e22"));   // both at once
  EXPECT_TRUE(taken_exactly("-9007199254740992e-22"));
  EXPECT_TRUE(taken_exactly("0.000000000000000001"));  // 19 digits
  EXPECT_TRUE(taken_exactly("1e0022"));                // a 4-digit exponent
}

TEST(short_decimal, leaves_everything_else_to_from_chars) {
  for (const char* text : {"9007199254740993",          // 2^53 + 1: not a double exactly
                           "12345678901234567890",      // 20 digits
                           "0.0000000000000000001",     // 20 digits, however small
                           "1e23", "1e-23", "0e23",     // 10^23 is no double exactly
                           "1e00001", "1e00000001",     // 5 and 8 exponent digits
                           "1e9999",                    // 4, but too large
                           "4.9406564584124654e-324",   // subnormal, and 17 digits
                           "1.7976931348623157e308", "+1", "+.5", "inf", "-inf", "Infinity", "nan",
                           "NaN", "NA", "", "-", ".", "-.", ".e1", "e5", "1e", "1e+", "1e-", "--1", "-+1"}) {
    const std::string cell = cell_of(text);
    double v = 0;
    EXPECT_EQ(parse_short_decimal(cell.data(), v), nullptr) << text;
  }
}

TEST(short_decimal, stops_at_the_first_character_not_of_the_number) {
  // from_chars stops there too; the reader then parses the cell the careful way.
  EXPECT_TRUE(taken_exactly("1.5 "));
  EXPECT_TRUE(taken_exactly("0x10"));
  EXPECT_TRUE(taken_exactly("2e5x"));
  const std::string line = "7.25\n12345678";  // the padding: digits, read and left alone
  double v = 0;
  EXPECT_EQ(parse_short_decimal(line.data(), v), line.data() + 4);
  EXPECT_EQ(v, 7.25);
}

TEST(short_decimal, random_decimals_match_from_chars_bit_for_bit) {
  std::mt19937_64 gen(42);
  int64_t taken = 0;
  constexpr int kCount = 200000;
  for (int i = 0; i < kCount; ++i) {
    const int digits = 1 + int(gen() % 20);
    std::string text = gen() % 2 ? "-" : "";
    const int point = int(gen() % uint64_t(digits + 1));
    for (int d = 0; d < digits; ++d) {
      if (d == point) text += '.';
      text += char('0' + gen() % 10);
    }
    if (gen() % 2) text += "e" + std::to_string(int(gen() % 61) - 30);
    taken += taken_exactly(text);
  }
  // Most of them are short enough: the fast path is the usual one.
  EXPECT_GT(taken, kCount / 2);
}

}  // namespace
