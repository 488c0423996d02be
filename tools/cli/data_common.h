// data_common.h — what `nanguard scan` and `nanguard clean` share: reading a
// CSV file as input errors (exit 2), finding the label column, and the first
// streaming pass that fits the column statistics.
#pragma once

#include "commands.h"

#include <nanguard/column_stats.h>
#include <nanguard/csv.h>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <malloc.h>

#include <memory>
#include <string>
#include <vector>

namespace nanguard::cli {

/// Rows per batch when streaming a CSV file.
constexpr int64_t kDataBatchRows = 65536;

/// Runs `fn`, turning a c10::Error (a bad CSV file) into a usage_error (exit 2).
template <typename F>
auto as_input_error(F&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const c10::Error& e) {
    throw usage_error(e.what_without_backtrace());
  }
}

/// Opens `path` for streaming; a missing or malformed file is a usage_error.
inline std::unique_ptr<csv_reader> open_csv(const std::string& path) {
  return as_input_error([&] { return std::make_unique<csv_reader>(path); });
}

/// The index of column `name` (or -1 when `name` is empty); a usage_error
/// listing the columns when there is no such column.
inline int64_t find_column(const std::vector<std::string>& columns, const std::string& name,
                           const std::string& path) {
  if (name.empty()) return -1;
  for (size_t j = 0; j < columns.size(); ++j)
    if (columns[j] == name) return int64_t(j);
  throw usage_error(fmt::format("no column '{}' in '{}'; its columns are: {}", name, path,
                                fmt::join(columns, ", ")));
}

/// Makes glibc serve batch-sized buffers (>= 1 MiB) with mmap and give them
/// back when freed. Its adaptive threshold otherwise moves them into the heap,
/// which fragments: the resident size grew by ~5 MB per 65536-row batch, so
/// with the file, instead of staying flat. Called by the streaming commands.
inline void keep_memory_bounded() { mallopt(M_MMAP_THRESHOLD, 1 << 20); }

/// First pass: streams `path` into column statistics (bounded memory).
inline column_stats fit_columns(const std::string& path, uint64_t seed) {
  column_stats stats(column_stats_options().seed(seed));
  auto in = open_csv(path);
  as_input_error([&] {
    for (at::Tensor b = in->next_batch(kDataBatchRows); b.size(0) > 0; b = in->next_batch(kDataBatchRows))
      stats.update(b);
    if (stats.features() == 0) stats.update(at::empty({0, int64_t(in->columns().size())}, at::kDouble));
  });
  return stats;
}

/// Up to `max_shown` row numbers, then "... (N in all)".
inline std::string list_rows(const std::vector<int64_t>& rows, int64_t total, size_t max_shown = 10) {
  std::string s;
  for (size_t i = 0; i < rows.size() && i < max_shown; ++i) s += (i ? ", " : "") + std::to_string(rows[i]);
  if (total > int64_t(std::min(rows.size(), max_shown))) s += fmt::format(", ... ({} in all)", total);
  return s;
}

}  // namespace nanguard::cli
