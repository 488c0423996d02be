// fuzz_input.h — what the harnesses share: the fuzzer's bytes as a file
// (nanguard's readers take paths), and the contract they check: a reader
// given any bytes returns, or throws one c10::Error that names the file.
// Anything else (another exception, a crash, a leak, a hang) is a finding.
#pragma once

#include <c10/util/Exception.h>

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace nanguard::fuzz {

/// A folder of this process's own under the system's temporary folder.
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    auto d = std::filesystem::temp_directory_path() / ("nanguard-fuzz-" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    std::atexit([] {
      std::error_code ignored;
      std::filesystem::remove_all(scratch_dir(), ignored);
    });
    return d;
  }();
  return dir;
}

inline void write_bytes(const std::filesystem::path& path, const uint8_t* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), std::streamsize(size));
  if (!out.flush()) std::abort();
}

/// Runs `read`; a c10::Error is a clear refusal only when it names `file`.
template <class Read>
void expect_clear_error(const std::string& file, Read&& read) {
  try {
    read();
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    if (message.find(file) != std::string::npos) return;
    std::fprintf(stderr, "the error does not name '%s': %s\n", file.c_str(), message.c_str());
    std::abort();
  }
}

}  // namespace nanguard::fuzz
