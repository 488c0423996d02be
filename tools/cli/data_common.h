// data_common.h — what `nanguard scan` and `nanguard clean` share: reading a
// CSV file, or a pipe, twice with input errors (exit 2), finding the label
// column, and the first streaming pass that fits the column statistics.
#pragma once

#include "commands.h"
#include "temp_file.h"

#include <nanguard/column_stats.h>
#include <nanguard/csv.h>

#include "detail/printable.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <malloc.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
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

/// A CSV input that each pass of a command can read from its start: the file
/// itself or, for a pipe, a FIFO or /dev/stdin, which can be read only once
/// (a second open hung or found it empty), a temporary copy of it. Errors
/// name the input as the user gave it.
class csv_input {
 public:
  explicit csv_input(std::string path) : name_(std::move(path)) {
    struct stat st {};
    if (::stat(name_.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)) copy_to_temp();
  }

  /// A reader at the start of the data; a usage_error for a missing or
  /// malformed file.
  std::unique_ptr<csv_reader> open() const {
    return as_input_error([&] {
      return std::make_unique<csv_reader>(copy_ ? copy_->path() : name_, csv_options().name(name_));
    });
  }
  /// The input as the user named it.
  const std::string& name() const { return name_; }

 private:
  void copy_to_temp() {
    using file = std::unique_ptr<std::FILE, int (*)(std::FILE*)>;
    const file in(std::fopen(name_.c_str(), "rb"), std::fclose);
    if (!in) throw usage_error(fmt::format("cannot open '{}': {}", name_, std::strerror(errno)));
    copy_.emplace("nanguard-input-");
    const file out(std::fopen(copy_->path().c_str(), "wb"), std::fclose);
    std::vector<char> buf(size_t(1) << 20);
    bool written = out != nullptr;
    for (size_t n; written && (n = std::fread(buf.data(), 1, buf.size(), in.get())) > 0;)
      written = std::fwrite(buf.data(), 1, n, out.get()) == n;
    if (std::ferror(in.get())) throw usage_error(fmt::format("cannot read '{}': {}", name_, std::strerror(errno)));
    if (!written || std::fflush(out.get()) != 0)
      throw usage_error(fmt::format("cannot copy '{}' to '{}' to read it twice: {}; set TMPDIR to a directory "
                                    "with room", name_, copy_->path(), std::strerror(errno)));
  }

  std::string name_;
  std::optional<temp_file> copy_;
};

/// The index of column `name` (or -1 when `name` is empty); a usage_error
/// listing the columns when there is no such column.
inline int64_t find_column(const std::vector<std::string>& columns, const std::string& name,
                           const std::string& path) {
  if (name.empty()) return -1;
  for (size_t j = 0; j < columns.size(); ++j)
    if (columns[j] == name) return int64_t(j);
  std::vector<std::string> shown;  // control bytes in a header must not reach the terminal
  for (const auto& c : columns) shown.push_back(detail::printable(c));
  throw usage_error(fmt::format("no column '{}' in '{}'; its columns are: {}", detail::printable(name), path,
                                fmt::join(shown, ", ")));
}

/// Makes glibc serve batch-sized buffers (>= 1 MiB) with mmap and give them
/// back when freed. Its adaptive threshold otherwise moves them into the heap,
/// which fragments: the resident size grew by ~5 MB per 65536-row batch, so
/// with the file, instead of staying flat. Called by the streaming commands.
inline void keep_memory_bounded() { mallopt(M_MMAP_THRESHOLD, 1 << 20); }

/// First pass: streams `input` into column statistics (bounded memory).
inline column_stats fit_columns(const csv_input& input, uint64_t seed) {
  column_stats stats(column_stats_options().seed(seed));
  auto in = input.open();
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
