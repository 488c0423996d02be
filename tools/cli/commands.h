// commands.h — the subcommands of the `nanguard` tool.
//
// Each subcommand registers its options on the CLI11 app and returns the
// function that runs it; main() parses, runs, and maps errors to exit codes.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>

namespace nanguard::cli {

/// A registered subcommand and the function that runs it once parsed.
struct command {
  CLI::App* app;             ///< the subcommand's parser
  std::function<int()> run;  ///< runs it; returns the process exit code
};

/// Exit codes shared by every subcommand.
enum exit_code : int {
  exit_ok = 0,
  exit_failure = 1,    ///< an unexpected internal error
  exit_usage = 2,      ///< bad usage or bad input (file, column, model)
  exit_nonfinite = 3,  ///< the run stopped on a non-finite value
};

/// A usage or input error: reported as one line, exit code 2.
struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// The --help footer of a command: what each exit code means, the same words
/// for 2 and 1 everywhere. `ok` says when it exits 0, `nonfinite` when 3
/// (empty: never).
///
///   sub->footer(exit_codes("written"));
inline std::string exit_codes(const std::string& ok, const std::string& nonfinite = "") {
  return "Exit codes: 0 " + ok + "; " + (nonfinite.empty() ? "" : "3 " + nonfinite + "; ") +
         "2 bad input or usage (a missing, malformed or unwritable file, a bad option: one line says what); "
         "1 an internal error (a bug: please report it).";
}

command add_census_command(CLI::App& app);
command add_launch_command(CLI::App& app);
command add_demo_command(CLI::App& app);
command add_scan_command(CLI::App& app);
command add_clean_command(CLI::App& app);
command add_advise_command(CLI::App& app);
command add_report_command(CLI::App& app);
command add_train_command(CLI::App& app);
command add_inspect_command(CLI::App& app);
command add_replay_command(CLI::App& app);

}  // namespace nanguard::cli
