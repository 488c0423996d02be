// temp_file.h — temporary files that a command leaves behind in no way it
// can end: on return and on an error (the destructors), and when SIGINT or
// SIGTERM stops it (a handler removes every registered temporary, then lets
// the signal end the process as it would have: exit status 128 + signal).
//
//   temp_file spool("nanguard-stdin-");         // $TMPDIR/nanguard-stdin-XXXXXX
//   csv_writer out(path, names);                // writes path.tmp.* until commit()
//   removed_on_signal cleanup(out.temp_path());
#pragma once

#include <string>

namespace nanguard::cli {

/// While it lives, SIGINT or SIGTERM removes `path` before the process ends.
/// For a temporary file that its owner removes otherwise (csv_writer's).
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
/// when SIGINT or SIGTERM stops the process.
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

}  // namespace nanguard::cli
