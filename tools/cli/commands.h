// commands.h — the subcommands of the `nanguard` tool.
//
// Each subcommand registers its options on the CLI11 app and returns the
// function that runs it; main() parses, runs, and maps errors to exit codes.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

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
