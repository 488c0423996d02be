// timing.h — side-by-side timing for the bench programs: variants run
// round-robin in rotating order, and ratios are medians of per-round ratios
// with a distribution-free 95% interval, so that a shared machine's slow
// phases hit every variant alike.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <vector>

namespace nanguard::bench {

/// Seconds one call of `fn` takes.
inline double seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// The median of `v`.
inline double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

/// Runs the variants round-robin for `rounds` rounds, after one warm-up
/// each, the order rotating every round so that no variant always follows
/// the same one; returns seconds per call as [variant][round]. Side by side,
/// slow phases of a shared machine hit every variant alike.
inline std::vector<std::vector<double>> interleaved_seconds(const std::vector<std::function<void()>>& variants,
                                                            int rounds) {
  for (const auto& v : variants) v();
  std::vector<std::vector<double>> times(variants.size());
  for (int r = 0; r < rounds; ++r)
    for (size_t k = 0; k < variants.size(); ++k) {
      const size_t i = (k + size_t(r)) % variants.size();
      times[i].push_back(seconds(variants[i]));
    }
  return times;
}

/// Each variant's median seconds per call, measured by interleaved_seconds.
inline std::vector<double> median_seconds(const std::vector<std::function<void()>>& variants, int rounds) {
  std::vector<double> medians;
  for (auto& t : interleaved_seconds(variants, rounds)) medians.push_back(median(t));
  return medians;
}

/// How much slower a variant is than the baseline: the median over rounds
/// of the ratio of their times in the same round, and a 95% confidence
/// interval for it (distribution-free, from the order statistics).
struct ratio_estimate {
  double median, low, high;
};

inline ratio_estimate paired_ratio(const std::vector<double>& variant, const std::vector<double>& baseline) {
  std::vector<double> r;
  for (size_t i = 0; i < variant.size() && i < baseline.size(); ++i) r.push_back(variant[i] / baseline[i]);
  std::sort(r.begin(), r.end());
  const double n = double(r.size()), half_width = 0.98 * std::sqrt(n);  // 1.96 sigma of Binomial(n, 1/2)
  const auto at = [&](double k) { return r[size_t(std::clamp(k, 0.0, n - 1))]; };
  return {median(r), at(std::floor(n / 2 - half_width)), at(std::ceil(n / 2 + half_width) - 1)};
}

}  // namespace nanguard::bench
