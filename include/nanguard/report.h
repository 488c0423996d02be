// report.h — one self-contained HTML page about one or more guarded runs:
// loss, global and top-k per-parameter grad norms, loss scale and LR on a
// shared step axis (skipped steps and rollbacks marked, NaN/Inf shown as
// markers), the event timeline, and every finding with its statistics.
// The page needs no network: its charting code and styles are inlined and
// the events are embedded as JSON. Long runs are downsampled for plotting
// (min and max of each bucket, every non-finite and skipped step kept).
// Data events (action "data", nanguard.data's firewall counts) are no steps:
// they are summed per source into one row of the event timeline.
//
//   std::vector<nanguard::report_run> runs;
//   runs.push_back({"baseline", nanguard::read_events("baseline/events.jsonl")});
//   runs.push_back({"guarded", nanguard::read_events("guarded/events.jsonl")});
//   nanguard::write_html_report(runs, "report.html", "lr sweep");
#pragma once

#include <nanguard/events.h>

#include <string>
#include <vector>

namespace nanguard {

/// One run of a report: a name (shown in the summary and as a heading) and
/// its step events, in the order they were logged.
struct report_run {
  std::string name;                ///< e.g. the log's directory, "baseline"
  std::vector<step_event> events;  ///< e.g. read_events("baseline/events.jsonl")
};

/// The report as one HTML document (UTF-8). Runs without events are listed
/// with a note. Throws c10::Error when `runs` is empty.
///
///   std::string html = nanguard::render_html_report({{"run", events}});
std::string render_html_report(const std::vector<report_run>& runs,
                               const std::string& title = "nanguard report");

/// Writes render_html_report(runs, title) to `path` atomically (a temporary
/// file in the same directory, then renamed). Throws c10::Error naming the
/// path when it cannot be written.
///
///   nanguard::write_html_report({{"run", events}}, "out/report.html");
void write_html_report(const std::vector<report_run>& runs, const std::string& path,
                       const std::string& title = "nanguard report");

}  // namespace nanguard
