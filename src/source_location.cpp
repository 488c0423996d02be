#include "nanguard/source_location.h"

#include "detail/call_stack.h"

#include <fmt/format.h>
#include <torch/csrc/profiler/combined_traceback.h>

#include <algorithm>
#include <mutex>
#include <string_view>

namespace nanguard {
namespace {

struct library_directories {
  std::mutex mutex;
  std::vector<std::string> paths;
};

library_directories& libraries() {
  static library_directories dirs;
  return dirs;
}

// True for a file under one of `directories`.
bool under_any(std::string_view file, const std::vector<std::string>& directories) {
  return std::any_of(directories.begin(), directories.end(),
                     [&](const std::string& dir) { return file.substr(0, dir.size()) == dir; });
}

}  // namespace

std::string to_string(const source_location& where) {
  if (!where.known()) return "";
  return where.function.empty() ? fmt::format("{}:{}", where.file, where.line)
                                : fmt::format("{}:{} ({})", where.file, where.line, where.function);
}

void set_library_paths(std::vector<std::string> directories) {
  for (std::string& dir : directories)
    if (!dir.empty() && dir.back() != '/') dir += '/';  // "torch/" must not match "torchvision/"
  library_directories& dirs = libraries();
  std::lock_guard<std::mutex> lock(dirs.mutex);
  dirs.paths = std::move(directories);
}

std::vector<std::string> library_paths() {
  library_directories& dirs = libraries();
  std::lock_guard<std::mutex> lock(dirs.mutex);
  return dirs.paths;
}

namespace detail {

call_stack capture_call_stack() {
  return torch::CapturedTraceback::gather(/*python=*/true, /*script=*/true, /*cpp=*/false);
}

source_location user_frame(const call_stack& stack) {
  if (!stack) return {};
  const torch::SymbolizedTracebacks symbols = torch::symbolize({stack.get()});
  const std::vector<std::string> skipped = library_paths();
  for (const uint64_t i : symbols.tracebacks.at(0)) {  // innermost first
    const torch::unwind::Frame& frame = symbols.all_frames.at(i);
    if (frame.lineno > 0 && !under_any(frame.filename, skipped))
      return {frame.filename, int64_t(frame.lineno), frame.funcname};
  }
  return {};
}

}  // namespace detail
}  // namespace nanguard
