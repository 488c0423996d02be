#include "temp_file.h"

#include "commands.h"

#include <fmt/format.h>

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>

namespace nanguard::cli {
namespace {

constexpr int held_signals[] = {SIGINT, SIGTERM, SIGHUP};

std::atomic<int> holders{0};         // live signals_held objects
std::atomic<int> pending_signal{0};  // the first signal that came while held

[[noreturn]] void end_by(int sig) {
  std::signal(sig, SIG_DFL);
  std::raise(sig);
  std::_Exit(128 + sig);  // only if the default action did not end the process
}

extern "C" void on_signal(int sig) {
  // Held: remember the first signal, act on it when the write is done.
  if (holders.load() > 0 && pending_signal.exchange(sig) == 0) return;
  end_by(sig);
}

[[noreturn]] void fail(const std::string& path, int err) {
  throw usage_error(fmt::format("cannot write '{}': {}; check that its directory exists, is writable and has free space",
                                path, std::strerror(err)));
}

}  // namespace

signals_held::signals_held() { ++holders; }

signals_held::~signals_held() {
  if (--holders == 0)
    if (const int sig = pending_signal.exchange(0)) end_by(sig);
}

void install_signal_handlers() {
  for (const int sig : held_signals)
    if (std::signal(sig, on_signal) == SIG_IGN) std::signal(sig, SIG_IGN);  // keep an inherited "ignore"
}

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
