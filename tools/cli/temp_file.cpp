#include "temp_file.h"

#include <fmt/format.h>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <stdexcept>
#include <vector>

namespace nanguard::cli {
namespace {

constexpr int kSignals[] = {SIGINT, SIGTERM};

// The paths to remove on a signal. The handler may only make async-signal-safe
// calls, so it reads this fixed table of lock-free pointers (no lock, no heap)
// and calls unlink().
constexpr int kSlots = 64;
std::atomic<const char*> g_paths[kSlots];
struct sigaction g_previous[sizeof kSignals / sizeof kSignals[0]];

void remove_and_reraise(int sig) {
  for (auto& p : g_paths)
    if (const char* path = p.exchange(nullptr)) ::unlink(path);
  for (size_t i = 0; i < sizeof kSignals / sizeof kSignals[0]; ++i)
    if (kSignals[i] == sig) ::sigaction(sig, &g_previous[i], nullptr);
  ::raise(sig);  // blocked until the handler returns, then the previous action
}

// Once, for each signal that is not ignored (nohup, a shell's background job).
void install_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (size_t i = 0; i < sizeof kSignals / sizeof kSignals[0]; ++i) {
      ::sigaction(kSignals[i], nullptr, &g_previous[i]);
      if (g_previous[i].sa_handler == SIG_IGN) continue;
      struct sigaction sa {};
      sa.sa_handler = remove_and_reraise;
      sigemptyset(&sa.sa_mask);
      for (int s : kSignals) sigaddset(&sa.sa_mask, s);  // one cleanup at a time
      ::sigaction(kSignals[i], &sa, nullptr);
    }
  });
}

std::string make_temp(const std::string& prefix) {
  std::string path = (std::filesystem::temp_directory_path() / (prefix + "XXXXXX")).string();
  const int fd = ::mkstemp(path.data());
  if (fd < 0)
    throw std::runtime_error(fmt::format("cannot create a temporary file '{}': {}; set TMPDIR to a writable "
                                         "directory", path, std::strerror(errno)));
  ::close(fd);
  return path;
}

}  // namespace

removed_on_signal::removed_on_signal(std::string path) : path_(std::move(path)), slot_(-1) {
  install_handlers();
  for (int i = 0; i < kSlots && slot_ < 0; ++i) {
    const char* empty = nullptr;
    if (g_paths[i].compare_exchange_strong(empty, path_.c_str())) slot_ = i;
  }
  if (slot_ < 0) throw std::runtime_error(fmt::format("more than {} temporary files at once", kSlots));
}

removed_on_signal::~removed_on_signal() {
  const char* mine = path_.c_str();
  g_paths[slot_].compare_exchange_strong(mine, nullptr);
}

temp_file::temp_file(const std::string& prefix) : path_(make_temp(prefix)), on_signal_(path_) {}

temp_file::~temp_file() { std::remove(path_.c_str()); }

}  // namespace nanguard::cli
