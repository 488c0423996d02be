// report_detail.h — the pieces of the HTML report that are worth testing on
// their own: downsampling a series for plotting, and making text safe to put
// inside HTML and inside a <script> element.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace nanguard::detail {

/// The indices (ascending) of the points of `y` to plot when at most about
/// `max_points` fit: all of them when y.size() <= max_points; otherwise the
/// first and last point, the smallest and largest finite value of each of
/// max_points / 2 equal buckets, and every non-finite point and every point
/// whose `keep` flag is set (`keep` is empty or as long as `y`).
///
///   auto idx = downsample_indices(loss, skipped, 2000);  // ~2000 of 100k
std::vector<size_t> downsample_indices(const std::vector<double>& y, const std::vector<bool>& keep,
                                       size_t max_points);

/// `text` with &, <, >, " and ' replaced by character references.
std::string html_escape(const std::string& text);

/// JSON text made safe inside a <script> element: every '<' becomes \u003c
/// (valid JSON, since '<' only occurs inside strings), so no string can
/// close the element ("</script>") or open a comment ("<!--").
std::string script_safe_json(const std::string& json);

}  // namespace nanguard::detail
