// median.h — the median of a series of values (the upper one of an even
// count), as the diagnosis and the guard read a run's losses.
#pragma once

#include <algorithm>
#include <limits>
#include <vector>

namespace nanguard::detail {

/// The median of `v` (of an even count, the upper middle value); NaN when empty.
inline double median(std::vector<double> v) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

}  // namespace nanguard::detail
