// `nanguard report EVENTS.jsonl [MORE.jsonl ...] -o report.html [--title T]
// [--tensorboard DIR]`: one self-contained HTML page (see nanguard/report.h)
// about the runs the event logs describe, and/or TensorBoard event files
// (nanguard/tensorboard.h): one log into DIR, several into DIR/<run name>.
// Each log is a run named after its file, or after its
// directory when the file is called events.jsonl (`baseline/events.jsonl` is
// the run "baseline"). A missing or malformed log is exit 2, naming the file
// and the line; so are logs that hold no event (one beside others that do
// is a warning, and an "empty" run on the page).
#include "commands.h"
#include "temp_file.h"

#include <nanguard/events.h>
#include <nanguard/report.h>
#include <nanguard/tensorboard.h>

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

namespace nanguard::cli {
namespace {

struct report_args {
  std::vector<std::string> logs;
  std::string output;
  std::string tensorboard;
  std::string title = "nanguard report";
};

// One line of an error message.
std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  return s;
}

// The run's name: the file's stem, or its directory for .../events.jsonl.
std::string run_name(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  if (p.filename() == "events.jsonl") {
    const fs::path dir = fs::absolute(p).parent_path().filename();
    if (!dir.empty()) return dir.string();
  }
  return p.stem().string();
}

// Reads a JSONL event log; a usage_error naming the file and line otherwise.
std::vector<step_event> read_log(const std::string& path) {
  if (std::filesystem::is_directory(path))
    throw usage_error(fmt::format("'{}' is a directory; pass the event log in it (e.g. {}/events.jsonl)", path, path));
  try {
    return read_events(path);
  } catch (const c10::Error& e) {
    throw usage_error(one_line(e.what_without_backtrace()));
  }
}

// What is wrong with a log that holds no event, and what to check.
std::string no_events(const std::string& path) {
  std::error_code ec;
  const auto bytes = std::filesystem::file_size(path, ec);
  return fmt::format("the event log '{}' holds no events ({}): the run wrote none (it stopped before its first "
                     "step, or its guard logs to another file); check the path: the guard's event_log, or "
                     "DIR/events.jsonl of `nanguard train --out DIR`",
                     path, !ec && bytes > 0 ? "only blank lines" : "it is empty");
}

// A report of logs without events would look like runs that did nothing:
// when none holds an event it is an error, otherwise each empty one is
// said (the page shows it as an "empty" run beside the others).
void check_some_events(const std::vector<report_run>& runs, const std::vector<std::string>& paths) {
  std::vector<std::string> empty;
  for (size_t i = 0; i < runs.size(); ++i)
    if (runs[i].events.empty()) empty.push_back(paths[i]);
  if (empty.size() == runs.size()) throw usage_error(no_events(empty.front()));
  for (const auto& path : empty) std::fprintf(stderr, "nanguard: warning: %s\n", no_events(path).c_str());
}

// The page must not replace one of the logs it is made from.
void check_output_is_no_log(const report_args& a) {
  std::error_code ec;
  for (const auto& path : a.logs)
    if (std::filesystem::equivalent(path, a.output, ec))
      throw usage_error(fmt::format("the output {} is the event log {}; writing the page would replace the log. "
                                    "Name another file, e.g. -o report.html",
                                    a.output, path));
}

// Writes each run's events as TensorBoard event files: one run into `dir`,
// several into dir/<run name> (TensorBoard shows each subdirectory as a run).
void write_tensorboard(const std::vector<report_run>& runs, const std::string& dir) {
  namespace fs = std::filesystem;
  for (const auto& run : runs) {
    const std::string logdir = runs.size() == 1 ? dir : (fs::path(dir) / run.name).string();
    std::unique_ptr<tensorboard_writer> tb;
    try {
      tb = std::make_unique<tensorboard_writer>(logdir);
      for (const auto& e : run.events) write_step_event(*tb, e);
    } catch (const c10::Error& e) {
      throw usage_error(one_line(e.what_without_backtrace()) + " (--tensorboard " + dir + ")");
    }
    fmt::print("wrote {} ({} events of {})\n", tb->path(), run.events.size(), run.name);
  }
}

int run_report(const report_args& a) {
  if (a.output.empty() && a.tensorboard.empty())
    throw usage_error("nothing to write: pass -o report.html for the HTML page, --tensorboard DIR for "
                      "TensorBoard event files, or both");
  if (!a.output.empty()) check_output_is_no_log(a);
  std::vector<report_run> runs;
  for (const auto& path : a.logs) {
    report_run r{run_name(path), read_log(path)};
    // Two logs with one name ("a/events.jsonl", "b/a/events.jsonl"): number them.
    int same = 0;
    for (const auto& other : runs)
      if (other.name == r.name || other.name.rfind(r.name + " (", 0) == 0) ++same;
    if (same) r.name += fmt::format(" ({})", same + 1);
    runs.push_back(std::move(r));
  }
  check_some_events(runs, a.logs);
  if (!a.tensorboard.empty()) write_tensorboard(runs, a.tensorboard);
  if (a.output.empty()) return exit_ok;
  write_file_atomically(a.output, render_html_report(runs, a.title));
  int64_t events = 0;
  for (const auto& r : runs) events += int64_t(r.events.size());
  fmt::print("wrote {} ({} run{}, {} steps, {:.0f} KiB)\n", a.output, runs.size(), runs.size() == 1 ? "" : "s",
             events, double(std::filesystem::file_size(a.output)) / 1024.0);
  return exit_ok;
}

}  // namespace

command add_report_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "report", "One self-contained HTML page of guarded runs: loss, grad norms, loss scale, LR, events, findings");
  auto a = std::make_shared<report_args>();
  sub->add_option("logs", a->logs,
                  "event logs (JSONL) written by the guard; each is one run, named after its file "
                  "(or its directory for events.jsonl)")
      ->required();
  sub->add_option("-o,--output", a->output, "the HTML file to write, e.g. report.html");
  sub->add_option("--tensorboard", a->tensorboard,
                  "also (or instead) write TensorBoard event files into this directory (made when missing; "
                  "several logs go to DIR/<run name>): tensorboard --logdir DIR");
  sub->add_option("--title", a->title, "the page's title");
  sub->footer(exit_codes("written") +
              "\nExample: nanguard report baseline/events.jsonl guarded/events.jsonl -o report.html"
              "\n         nanguard report train.jsonl --tensorboard runs/train");
  return {sub, [a] { return run_report(*a); }};
}

}  // namespace nanguard::cli
