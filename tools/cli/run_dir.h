// run_dir.h — the output directory of one run (`train --out`, `demo --out`).
// A run locks it (flock on DIR/.nanguard.lock, which holds the run's pid), so
// a second run into it fails at once naming the first; then it removes what
// a previous run left there (its outputs and their temporaries), so nothing
// in the directory looks like this run's output unless this run wrote it.
// A directory no run has held (no lock file) that holds files of those names
// is refused: they are the user's.
#pragma once

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace nanguard::cli {

/// A command-line input: the option that named it and its path.
struct named_input {
  std::string option;  ///< e.g. "--data"
  std::string path;
};

/// The locked output directory of this run; unlocked when destroyed.
///
///   run_directory out("nanguard-train", {"events.jsonl", "summary.json", "report.html", "bundles"},
///                     {{"--model", model}, {"--data", data}});
///   write_file_atomically(out / "summary.json", text);
class run_directory {
 public:
  /// Creates `path`, locks it and removes the previous run's `outputs`
  /// (names of files or directories in it) and their temporaries. A
  /// usage_error when one of `inputs` is the directory or inside one of the
  /// outputs, when the directory cannot be created, when another run
  /// holds it, or when it holds one of the outputs but no run held it.
  run_directory(const std::string& path, std::vector<std::string> outputs, const std::vector<named_input>& inputs);
  ~run_directory();
  run_directory(const run_directory&) = delete;
  run_directory& operator=(const run_directory&) = delete;

  /// The path of `name` in the directory, e.g. out / "summary.json".
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  void refuse_inputs(const std::vector<named_input>& inputs) const;
  std::vector<std::filesystem::path> previous_outputs() const;
  void refuse_foreign_outputs() const;
  void lock();
  void remove_previous_outputs() const;

  std::filesystem::path path_;
  std::vector<std::string> outputs_;
  int lock_fd_ = -1;
};

}  // namespace nanguard::cli
