// temp_file.h — files written through a temporary name: the bytes go to
// `PATH.tmp-PID` next to PATH, then a rename puts them in place, so no reader
// and no interrupted run ever sees a half-written PATH. SIGINT, SIGTERM and
// SIGHUP are held while a write is under way (signals_held), so the
// temporary is renamed or removed before the signal ends the process.
#pragma once

#include <string>
#include <string_view>

namespace nanguard::cli {

/// Writes `bytes` to `path` through `path.tmp-PID` and a rename, with signals
/// held. A usage_error naming `path` and the reason (disk full, no such
/// directory, not a regular file) when it cannot; the temporary is removed.
///
///   write_file_atomically("run/summary.json", json_text);
void write_file_atomically(const std::string& path, std::string_view bytes);

/// Whether the file name `name` is a temporary that write_file_atomically
/// made for a file named `output` (a run directory removes those a killed
/// run left).
bool is_temporary_of(const std::string& name, const std::string& output);

/// While one lives, SIGINT, SIGTERM and SIGHUP are held: the first such
/// signal ends the process when the last signals_held ends, a second one at
/// once. Wrap every write that leaves a temporary behind when cut short
/// (a bundle directory, a file and its rename).
///
///   { signals_held hold;  write_bundle(dir, b); }
class signals_held {
 public:
  signals_held();
  ~signals_held();
  signals_held(const signals_held&) = delete;
  signals_held& operator=(const signals_held&) = delete;
};

/// Installs the handlers signals_held relies on; main() calls it once. Where
/// nothing is held, each signal keeps its default action (the process ends).
void install_signal_handlers();

}  // namespace nanguard::cli
