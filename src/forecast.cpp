#include "nanguard/forecast.h"

#include <c10/util/Exception.h>

#include <fmt/format.h>

#include <cmath>

namespace nanguard {

namespace {

// Below this average growth a step a rise is not called a divergence: a
// healthy loss goes up a few steps in a row now and then, but not by 1.2x
// each time for a whole window.
constexpr double min_growth = 1.2;

}  // namespace

std::string to_string(const range_forecast& f) {
  const std::string when = f.steps_left == 0 ? "at the next step"
                           : f.steps_left == 1 ? "in about 1 step"
                                               : fmt::format("in about {} steps", f.steps_left);
  return fmt::format("the {} ({:.4g}) leaves the range {:.6g} {} (x{:.3g} a step)", f.series == "loss" ? "loss" : "grad norm",
                     f.value, f.limit, when, f.growth);
}

range_trend::range_trend(int64_t window, int64_t horizon) : window_(window), horizon_(horizon) {
  TORCH_CHECK(window >= 3, "nanguard::range_trend: window must be at least 3 but is ", window);
  TORCH_CHECK(horizon >= 1, "nanguard::range_trend: horizon must be at least 1 but is ", horizon);
}

void range_trend::add(double value) {
  if (!std::isfinite(value) || value <= 0) return reset();
  logs_.push_back(std::log(value));
  if (int64_t(logs_.size()) > window_) logs_.pop_front();
}

std::optional<range_forecast> range_trend::forecast(const std::string& series, double limit) const {
  if (int64_t(logs_.size()) < window_ || !(limit > 0)) return std::nullopt;
  for (size_t i = 1; i < logs_.size(); ++i)
    if (logs_[i] <= logs_[i - 1]) return std::nullopt;
  const double rate = (logs_.back() - logs_.front()) / double(logs_.size() - 1);  // log growth a step
  if (rate < std::log(min_growth)) return std::nullopt;
  const double steps = (std::log(limit) - logs_.back()) / rate;
  if (steps > double(horizon_)) return std::nullopt;
  range_forecast f;
  f.series = series;
  f.value = std::exp(logs_.back());
  f.growth = std::exp(rate);
  f.limit = limit;
  f.steps_left = std::max<int64_t>(0, static_cast<int64_t>(std::floor(steps)));
  return f;
}

}  // namespace nanguard
