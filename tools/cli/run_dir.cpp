#include "run_dir.h"

#include "commands.h"
#include "temp_file.h"

#include <fmt/format.h>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace nanguard::cli {
namespace {

namespace fs = std::filesystem;

constexpr const char* lock_name = ".nanguard.lock";

// `p` made absolute and free of `.`, `..` and links where it exists.
fs::path resolved(const fs::path& p) {
  std::error_code ec;
  const fs::path r = fs::weakly_canonical(fs::absolute(p), ec);
  return ec ? fs::absolute(p).lexically_normal() : r;
}

bool is_within(const fs::path& p, const fs::path& dir) {
  const auto [d, q] = std::mismatch(dir.begin(), dir.end(), p.begin(), p.end());
  return d == dir.end();
}

// What the lock file says about the run holding it: "pid 1234", or less.
std::string holder(int fd) {
  char buf[32] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  const long pid = n > 0 ? std::strtol(buf, nullptr, 10) : 0;
  return pid > 0 ? fmt::format("pid {}", pid) : "pid unknown";
}

}  // namespace

run_directory::run_directory(const std::string& path, std::vector<std::string> outputs,
                             const std::vector<named_input>& inputs)
    : path_(path), outputs_(std::move(outputs)) {
  refuse_inputs(inputs);
  std::error_code ec;
  fs::create_directories(path_, ec);
  if (ec || !fs::is_directory(path_))
    throw usage_error(fmt::format("cannot create the output directory '{}': {}; pass a writable directory for --out",
                                  path, ec ? ec.message() : "it exists and is not a directory"));
  refuse_foreign_outputs();  // before lock() makes the directory a run's
  lock();
  remove_previous_outputs();
}

run_directory::~run_directory() {
  // Emptied first: a pid read from an unlocked file would name a run long gone.
  [[maybe_unused]] const int emptied = ::ftruncate(lock_fd_, 0);
  ::close(lock_fd_);  // releases the flock
}

void run_directory::refuse_inputs(const std::vector<named_input>& inputs) const {
  const fs::path dir = resolved(path_);
  for (const named_input& in : inputs) {
    const fs::path p = resolved(in.path);
    if (p == dir)
      throw usage_error(fmt::format("--out '{}' is the {} file; pass a new directory for --out", path_.string(),
                                    in.option));
    for (const std::string& name : outputs_)
      if (is_within(p, dir / name))
        throw usage_error(fmt::format("{} '{}' is in '{}', which this run replaces; move it out of the output "
                                      "directory or pass another --out", in.option, in.path,
                                      (path_ / name).string()));
  }
}

void run_directory::lock() {
  const std::string lock_path = (path_ / lock_name).string();
  lock_fd_ = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd_ < 0)
    throw usage_error(fmt::format("cannot create the lock file '{}': {}; pass a writable directory for --out",
                                  lock_path, std::strerror(errno)));
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    const std::string who = holder(lock_fd_);
    ::close(lock_fd_);
    if (err == EWOULDBLOCK)
      throw usage_error(fmt::format("'{}' is the output directory of another nanguard run ({}, named in {}); "
                                    "wait for it to end or pass another --out", path_.string(), who, lock_path));
    throw usage_error(fmt::format("cannot lock '{}': {}", lock_path, std::strerror(err)));
  }
  const std::string pid = fmt::format("{}\n", ::getpid());
  if (::ftruncate(lock_fd_, 0) != 0 || ::pwrite(lock_fd_, pid.data(), pid.size(), 0) != ssize_t(pid.size()))
    throw usage_error(fmt::format("cannot write the lock file '{}': {}", lock_path, std::strerror(errno)));
}

std::vector<fs::path> run_directory::previous_outputs() const {
  std::vector<fs::path> found;
  for (const fs::directory_entry& e : fs::directory_iterator(path_)) {
    const std::string name = e.path().filename().string();
    for (const std::string& output : outputs_)
      if (name == output || is_temporary_of(name, output)) found.push_back(e.path());
  }
  return found;
}

// A directory no nanguard run has held (no lock file) keeps what is in it:
// a `bundles/` there is the user's, not a previous run's.
void run_directory::refuse_foreign_outputs() const {
  if (fs::exists(path_ / lock_name)) return;
  const std::vector<fs::path> found = previous_outputs();
  if (!found.empty())
    throw usage_error(fmt::format("--out '{}' holds '{}', which this run would replace, but it is not the output "
                                  "directory of a nanguard run (no {}); pass a new or empty directory for --out, "
                                  "or move '{}' away",
                                  path_.string(), found.front().string(), lock_name, found.front().string()));
}

void run_directory::remove_previous_outputs() const {
  for (const fs::path& p : previous_outputs()) {
    std::error_code ec;
    fs::remove_all(p, ec);
    if (ec)
      throw usage_error(fmt::format("cannot remove '{}', left by a previous run: {}", p.string(), ec.message()));
  }
}

}  // namespace nanguard::cli
