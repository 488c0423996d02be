#include "temp_file.h"

#include "commands.h"

#include <fmt/format.h>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace nanguard::cli {
namespace {

constexpr int kSignals[] = {SIGINT, SIGTERM, SIGHUP};

// The temporaries to remove on a signal. The handler may only make
// async-signal-safe calls, so it reads this fixed table of lock-free
// pointers (no lock, no heap) and calls unlink().
constexpr int kSlots = 64;
std::atomic<const char*> registered[kSlots];

std::atomic<int> holders{0};         // live signals_held objects
std::atomic<int> pending_signal{0};  // the first signal that came while held

[[noreturn]] void end_by(int sig) {
  ::signal(sig, SIG_DFL);
  ::raise(sig);       // blocked while the handler runs: delivered when it returns...
  sigset_t unblock;   // ...or now, for a signal taken outside the handler
  sigemptyset(&unblock);
  sigaddset(&unblock, sig);
  ::sigprocmask(SIG_UNBLOCK, &unblock, nullptr);
  ::_exit(128 + sig);  // only if the default action did not end the process
}

extern "C" void on_signal(int sig) {
  for (auto& path : registered)
    if (const char* p = path.exchange(nullptr)) ::unlink(p);
  if (holders.load() > 0 && pending_signal.exchange(sig) == 0) return;  // the held write ends it
  end_by(sig);
}

[[noreturn]] void fail(const std::string& path, int err) {
  throw usage_error(fmt::format("cannot write '{}': {}; check that its directory exists, is writable and has free space",
                                path, std::strerror(err)));
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

void install_signal_handlers() {
  for (const int sig : kSignals) {
    struct sigaction previous {};
    ::sigaction(sig, nullptr, &previous);
    if (previous.sa_handler == SIG_IGN) continue;  // nohup, a shell's background job
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;  // a write or read under way goes on (the held write ends the process)
    sigemptyset(&sa.sa_mask);
    for (const int s : kSignals) sigaddset(&sa.sa_mask, s);  // one at a time
    ::sigaction(sig, &sa, nullptr);
  }
}

signals_held::signals_held() { ++holders; }

signals_held::~signals_held() {
  if (--holders == 0)
    if (const int sig = pending_signal.exchange(0)) end_by(sig);
}

removed_on_signal::removed_on_signal(std::string path) : path_(std::move(path)), slot_(-1) {
  for (int i = 0; i < kSlots && slot_ < 0; ++i) {
    const char* empty = nullptr;
    if (registered[i].compare_exchange_strong(empty, path_.c_str())) slot_ = i;
  }
  if (slot_ < 0) throw std::runtime_error(fmt::format("more than {} temporary files at once", kSlots));
}

removed_on_signal::~removed_on_signal() {
  const char* mine = path_.c_str();
  registered[slot_].compare_exchange_strong(mine, nullptr);
}

temp_file::temp_file(const std::string& prefix) : path_(make_temp(prefix)), on_signal_(path_) {}

temp_file::~temp_file() { std::remove(path_.c_str()); }

bool is_temporary_of(const std::string& name, const std::string& output) {
  return name.rfind(output + ".tmp-", 0) == 0;
}

void write_file_atomically(const std::string& path, std::string_view bytes) {
  std::error_code ec;
  if (std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec))
    throw usage_error(fmt::format("cannot write '{}': it exists and is not a regular file; name a file to write",
                                  path));
  const std::string tmp = fmt::format("{}.tmp-{}", path, ::getpid());
  signals_held hold;
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) fail(path, errno);
  const bool written = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size() && std::fflush(f) == 0 &&
                       ::fsync(::fileno(f)) == 0;
  const int write_error = errno;
  const bool closed = std::fclose(f) == 0;
  const int close_error = errno;
  if (!written || !closed) {
    std::remove(tmp.c_str());
    fail(path, !written ? write_error : close_error);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int rename_error = errno;
    std::remove(tmp.c_str());
    fail(path, rename_error);
  }
}

}  // namespace nanguard::cli
