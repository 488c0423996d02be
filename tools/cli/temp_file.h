// temp_file.h — how the commands leave no half-written or temporary file
// behind, whatever ends them:
//
//   write_file_atomically   a whole file through PATH.tmp-PID and a rename
//   temp_file               a temporary for a whole pass (a spooled pipe),
//                           removed on return, on an error and on a signal
//   removed_on_signal       registers a temporary its owner removes otherwise
//                           (csv_writer's, until commit())
//   signals_held            a short write (a file and its rename, a bundle
//                           directory) finishes before a signal ends the process
//
// main() installs the one handler for SIGINT, SIGTERM and SIGHUP
// (install_signal_handlers): it removes the registered temporaries, then
// ends the process with the signal (exit status 128 + signal) once no write
// is held. A signal the process inherited as ignored (nohup) stays ignored.
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

/// While one lives, SIGINT, SIGTERM and SIGHUP wait: the first such signal
/// ends the process when the last signals_held ends, a second one at once.
///
///   { signals_held hold;  write_bundle(dir, b); }
class signals_held {
 public:
  signals_held();
  ~signals_held();
  signals_held(const signals_held&) = delete;
  signals_held& operator=(const signals_held&) = delete;
};

/// While it lives, a signal removes `path` before the process ends. For a
/// temporary file that its owner removes otherwise (csv_writer's).
class removed_on_signal {
 public:
  explicit removed_on_signal(std::string path);
  ~removed_on_signal();
  removed_on_signal(const removed_on_signal&) = delete;
  removed_on_signal& operator=(const removed_on_signal&) = delete;

 private:
  std::string path_;
  int slot_;  // its entry in the table the signal handler reads
};

/// A new empty file in the temporary directory ($TMPDIR, else /tmp), named
/// `prefix` and six random characters; removed when this is destroyed or
/// when a signal ends the process.
///
///   temp_file spool("nanguard-stdin-");  // $TMPDIR/nanguard-stdin-XXXXXX
class temp_file {
 public:
  explicit temp_file(const std::string& prefix);
  ~temp_file();
  temp_file(const temp_file&) = delete;
  temp_file& operator=(const temp_file&) = delete;

  /// Where the file is.
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  removed_on_signal on_signal_;
};

/// Installs the signal handler described above; main() calls it once.
void install_signal_handlers();

}  // namespace nanguard::cli
