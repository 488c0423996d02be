// The `nanguard` command: parses the subcommand, runs it, and turns every
// error into one clear line and an exit code (see commands.h).
#include "commands.h"
#include "temp_file.h"

#include <nanguard/events.h>
#include <nanguard/version.h>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <string>
#include <vector>

namespace {

// The commands of `app` when `word` (the first argument) is none of them and
// no option, else empty: CLI11 says only "A subcommand is required".
std::string unknown_command(CLI::App& app, const std::string& word) {
  if (word.empty() || word[0] == '-') return {};
  std::vector<std::string> names;
  for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
    if (sub->get_name() == word) return {};
    names.push_back(sub->get_name());
  }
  return fmt::format("no command '{}'; the commands are {}; see nanguard --help", word, fmt::join(names, ", "));
}

}  // namespace

int main(int argc, char** argv) {
  using namespace nanguard::cli;
  install_signal_handlers();
  CLI::App app{"nanguard: find where NaN/Inf is born in LibTorch training, and keep it finite"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "nanguard " NANGUARD_VERSION);
  const std::vector<command> commands = {
      add_demo_command(app),
      add_census_command(app),
      add_launch_command(app),
      add_scan_command(app),
      add_clean_command(app),
      add_advise_command(app),
      add_report_command(app),
      add_train_command(app),
      add_inspect_command(app),
      add_replay_command(app),
  };

  if (const std::string unknown = argc > 1 ? unknown_command(app, argv[1]) : ""; !unknown.empty()) {
    std::fprintf(stderr, "nanguard: error: %s\n", unknown.c_str());
    return exit_usage;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? exit_ok : exit_usage;
  }
  try {
    for (const command& c : commands)
      if (c.app->parsed()) return c.run();
    return exit_usage;
  } catch (const usage_error& e) {
    std::fprintf(stderr, "nanguard: error: %s\n", e.what());
    return exit_usage;
  } catch (const nanguard::event_log_error& e) {  // a full disk is exit 2, as for the other outputs
    std::fprintf(stderr, "nanguard: error: %s\n", e.what_without_backtrace());
    return exit_usage;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "nanguard: error: %s\n", e.what_without_backtrace());
    return exit_failure;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nanguard: error: %s\n", e.what());
    return exit_failure;
  }
}
