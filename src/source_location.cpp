#include "nanguard/source_location.h"

#include <ATen/ops/empty_like_ops.h>
#include <fmt/format.h>

#include <dlfcn.h>

#include <filesystem>
#include <mutex>

namespace nanguard {
namespace {

// The directory of the torch package this LibTorch belongs to ("…/torch/"
// of "…/torch/lib/libtorch_cpu.so"), "" when it is not found.
std::string torch_package_directory() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&at::_ops::empty_like::call), &info) == 0 || !info.dli_fname) return "";
  const std::filesystem::path package = std::filesystem::path(info.dli_fname).parent_path().parent_path();
  return package.filename() == "torch" ? package.string() + "/" : "";
}

struct library_directories {
  std::mutex mutex;
  std::vector<std::string> paths;
};

// Torch's own Python code is library code from the start, for a C++ program
// too: a scripted model's archive maps its ops back to the files it was
// scripted from, nn.Linear's forward among them.
library_directories& libraries() {
  static library_directories dirs{{}, [] {
    std::string torch = torch_package_directory();
    return torch.empty() ? std::vector<std::string>() : std::vector<std::string>{torch};
  }()};
  return dirs;
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

}  // namespace nanguard
