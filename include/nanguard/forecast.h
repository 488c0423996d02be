// forecast.h — when a series that grows geometrically (a diverging loss, a
// grad norm, an activation's absmax) will leave its dtype's range: the
// trend of its last values, read as a line through their logarithms.
//
//   nanguard::range_trend t;
//   for (double loss : {10.0, 31.0, 95.0, 290.0, 880.0, 2700.0, 8100.0, 24000.0}) t.add(loss);
//   if (auto f = t.forecast("loss", 65504))  // float16's largest
//     std::cout << to_string(*f) << "\n";    // the loss leaves the range 65504 in about 1 step (x3 a step)
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>

namespace nanguard {

/// A series on its way out of range.
struct range_forecast {
  std::string series;      ///< "loss" or "grad_norm"
  double value = 0;        ///< its last value
  double growth = 1;       ///< its factor a step over the window (geometric mean)
  double limit = 0;        ///< the largest value its dtype holds
  int64_t steps_left = 0;  ///< steps until it passes `limit` at that growth (0: the next one)
};

/// "the loss leaves the range 3.40282e+38 in about 24 steps (x3.1 a step)".
std::string to_string(const range_forecast& f);

/// The last `window` values of one series and their trend.
class range_trend {
 public:
  /// `window` values make a trend (at least 3); a forecast further than
  /// `horizon` steps ahead is none.
  explicit range_trend(int64_t window = 8, int64_t horizon = 100);

  /// Adds the next value (a non-finite or non-positive one ends the trend:
  /// the window starts again).
  void add(double value);
  /// Forgets the values (after a rollback).
  void reset() { logs_.clear(); }
  /// Where the series leaves `limit`, when each of the window's values is
  /// above the one before, by 1.2x a step on average at least, and the
  /// range ends within the horizon; none otherwise (a healthy series: a
  /// falling, flat or noisy one, or a slow rise).
  std::optional<range_forecast> forecast(const std::string& series, double limit) const;

 private:
  int64_t window_, horizon_;
  std::deque<double> logs_;  // natural logarithms of the last values
};

}  // namespace nanguard
