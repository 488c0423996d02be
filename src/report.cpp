#include "nanguard/report.h"
#include "nanguard/remedy_check.h"
#include "nanguard/run_summary.h"
#include "nanguard/version.h"

#include "detail/json_number.h"
#include "detail/report_detail.h"
#include "nanguard/detail/report_assets.h"  // generated: report_css, report_js

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <unistd.h>

namespace nanguard {
namespace detail {

std::vector<size_t> downsample_indices(const std::vector<double>& y, const std::vector<bool>& keep,
                                       size_t max_points) {
  // The report builds `keep` from the same events as `y`.
  TORCH_INTERNAL_ASSERT(keep.empty() || keep.size() == y.size(), "nanguard::detail::downsample_indices: keep has ",
                        keep.size(), " flags for ", y.size(), " points (a bug in nanguard: please report it)");
  const size_t n = y.size();
  std::vector<size_t> out;
  if (n <= std::max<size_t>(max_points, 2)) {
    out.resize(n);
    for (size_t i = 0; i < n; ++i) out[i] = i;
    return out;
  }
  const size_t buckets = std::max<size_t>(max_points / 2, 1);
  out.reserve(max_points + 2);
  out.push_back(0);
  for (size_t b = 0; b < buckets; ++b) {
    const size_t lo = b * n / buckets, hi = (b + 1) * n / buckets;
    size_t imin = n, imax = n;
    for (size_t i = lo; i < hi; ++i) {
      const double v = y[i];
      if (!std::isfinite(v) || (!keep.empty() && keep[i])) {
        out.push_back(i);
        continue;
      }
      if (imin == n || v < y[imin]) imin = i;
      if (imax == n || v > y[imax]) imax = i;
    }
    if (imin != n) out.push_back(imin);
    if (imax != n) out.push_back(imax);
  }
  out.push_back(n - 1);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string html_escape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string script_safe_json(const std::string& json) {
  std::string out;
  out.reserve(json.size());
  for (char c : json) {
    if (c == '<') out += "\\u003c";
    else out += c;
  }
  return out;
}

}  // namespace detail

namespace {

using json = nlohmann::json;

// Per plotted series; per run at most this many named parameters.
constexpr size_t kMaxPlotPoints = 2000;
constexpr size_t kMaxParamSeries = 8;
// Beyond these the page lists how many were left out.
constexpr size_t kMaxTimelineRows = 2000;
constexpr size_t kMaxFindings = 200;
constexpr size_t kMaxMarkerRanges = 2000;

// Plotted values keep 6 significant digits: the page stays small and the
// plots look the same.
json plot_number(double v) {
  if (!std::isfinite(v) || v == 0) return detail::json_number(v);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return std::strtod(buf, nullptr);
}

std::string number_text(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

// {"x": [...], "y": [...]}, downsampled.
json series_json(const std::vector<int64_t>& x, const std::vector<double>& y, const std::vector<bool>& keep) {
  json xs = json::array(), ys = json::array();
  for (size_t i : detail::downsample_indices(y, keep, kMaxPlotPoints)) {
    xs.push_back(x[i]);
    ys.push_back(plot_number(y[i]));
  }
  return {{"x", std::move(xs)}, {"y", std::move(ys)}, {"points", y.size()}};
}

// Consecutive skipped steps as [first, last] ranges; when there are too many
// to draw, ranges closer than 1/kMaxMarkerRanges of the run are merged.
json skipped_ranges(const std::vector<step_event>& events) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const auto& e : events) {
    if (!e.skipped) continue;
    if (!ranges.empty() && e.step >= ranges.back().first && e.step <= ranges.back().second + 1)
      ranges.back().second = std::max(ranges.back().second, e.step);
    else
      ranges.emplace_back(e.step, e.step);
  }
  if (ranges.size() > kMaxMarkerRanges) {
    const int64_t span = events.back().step - events.front().step;
    const int64_t gap = std::max<int64_t>(span / int64_t(kMaxMarkerRanges), 1);
    std::vector<std::pair<int64_t, int64_t>> merged;
    for (const auto& r : ranges) {
      if (!merged.empty() && r.first - merged.back().second <= gap)
        merged.back().second = std::max(merged.back().second, r.second);
      else
        merged.push_back(r);
    }
    ranges.swap(merged);
  }
  json out = json::array();
  for (const auto& r : ranges) out.push_back({r.first, r.second});
  return out;
}

// The per-parameter grad norms (top_norms) as one series per parameter: the
// kMaxParamSeries parameters that were most often among the largest.
json parameter_series(const std::vector<step_event>& events, json& omitted) {
  struct acc {
    std::vector<int64_t> x;
    std::vector<double> y;
    std::vector<bool> keep;
    double max = -1;
  };
  std::map<std::string, acc> by_name;
  for (const auto& e : events)
    for (const auto& [name, norm] : e.top_norms) {
      acc& a = by_name[name];
      a.x.push_back(e.step);
      a.y.push_back(norm);
      a.keep.push_back(e.skipped);
      if (std::isfinite(norm)) a.max = std::max(a.max, norm);
    }
  std::vector<const std::pair<const std::string, acc>*> order;
  for (const auto& kv : by_name) order.push_back(&kv);
  std::stable_sort(order.begin(), order.end(), [](auto* a, auto* b) {
    if (a->second.x.size() != b->second.x.size()) return a->second.x.size() > b->second.x.size();
    return a->second.max > b->second.max;
  });
  json out = json::array();
  for (size_t i = 0; i < order.size() && i < kMaxParamSeries; ++i) {
    json s = series_json(order[i]->second.x, order[i]->second.y, order[i]->second.keep);
    s["name"] = order[i]->first;
    out.push_back(std::move(s));
  }
  omitted = order.size() > kMaxParamSeries ? order.size() - kMaxParamSeries : 0;
  return out;
}

bool notable(const step_event& e) {
  return e.action != action::step || e.skipped || !e.spikes.empty() || e.verdict != verdict::none ||
         e.fault != fault_class::none || !e.bundle.empty() ||
         !e.note.empty() || !e.nonfinite_params.empty() || !e.nonfinite_ranks.empty() || !e.findings.empty();
}

// One timeline row: the step, its action, and [kind, text] items.
json timeline_row(const step_event& e) {
  json items = json::array();
  if (!std::isfinite(e.loss)) items.push_back({"nonfinite", "loss = " + number_text(e.loss)});
  if (!e.nonfinite_params.empty()) {
    std::string text = "non-finite gradients in";
    for (size_t i = 0; i < e.nonfinite_params.size(); ++i) {
      if (i == 5) {
        text += " and " + std::to_string(e.nonfinite_params.size() - 5) + " more";
        break;
      }
      text += (i ? ", " : " ") + e.nonfinite_params[i].name + " (" +
              std::to_string(e.nonfinite_params[i].nonfinite) + ")";
    }
    items.push_back({"nonfinite", text});
  }
  if (!e.nonfinite_ranks.empty()) {
    std::string text = "ranks that saw a non-finite value:";
    for (int64_t r : e.nonfinite_ranks) text += " " + std::to_string(r);
    items.push_back({"ranks", text});
  }
  for (const auto& s : e.spikes)
    items.push_back({"spike", s.series + " spike: " + number_text(s.value) + " (z = " + number_text(s.z) + ")"});
  if (e.verdict != verdict::none) items.push_back({"verdict", std::string("replay: ") + to_string(e.verdict)});
  if (e.fault != fault_class::none) items.push_back({"verdict", std::string("fault: ") + to_string(e.fault)});
  for (const auto& f : e.findings) {
    items.push_back({"finding", to_string(f) + " (likely cause: " + to_string(f.diagnosis.cause) + ")"});
    if (const remedy_check* v = verified_remedy(f.remedy_checks))
      items.push_back({"verified", (v->applied.empty() ? std::string(to_string(v->remedy)) : v->applied) +
                                       " keeps the step finite (replayed loss " + number_text(v->loss) + ")"});
  }
  if (!e.remedy.empty()) items.push_back({"remedy", e.remedy});
  // A log written before the remedy field says only where it rolled back to.
  if (e.action == action::rollback && e.remedy.empty()) items.push_back({"rollback", "rolled back to the snapshot of step " + std::to_string(e.rollback_to)});
  if (!e.bundle.empty()) items.push_back({"bundle", "repro bundle: " + e.bundle});
  if (!e.note.empty()) items.push_back({"note", e.note});
  return {{"step", e.step}, {"action", to_string(e.action)}, {"skipped", e.skipped}, {"items", std::move(items)}};
}

std::string first_problem(const std::vector<step_event>& events) {
  for (const auto& e : events)
    if (!e.findings.empty()) return to_string(e.findings.front());
  for (const auto& e : events) {
    if (!std::isfinite(e.loss)) return "step " + std::to_string(e.step) + ": loss = " + number_text(e.loss) + " (not traced)";
    if (!e.nonfinite_params.empty())
      return "step " + std::to_string(e.step) + ": non-finite gradient in " + e.nonfinite_params.front().name +
             " (not traced)";
  }
  return "";
}

// The rows a data event names, "3" (a dataset index or a stream position) or
// "3 of check 7" (a row of that check's batch), appended to `out` up to
// `max_shown` in all; returns how many it named.
size_t name_data_rows(const data_counts& d, const std::vector<int64_t>& rows, size_t max_shown,
                      std::vector<std::string>& out) {
  for (int64_t r : rows)
    if (out.size() < max_shown)
      out.push_back(d.row_index != "batch" ? std::to_string(r)
                                           : std::to_string(r) + " of check " + std::to_string(d.check));
  return rows.size();
}

// "; dropped dataset indices 3, 40" ("stream positions 3", "rows 3 of check 1, ..."). Dataset
// indices in ascending order: DataLoader workers write their events in any order.
std::string listed_rows(const char* what, std::vector<std::string> named, size_t total, const std::string& index) {
  if (named.empty()) return "";
  if (index == "dataset")
    std::sort(named.begin(), named.end(), [](const std::string& a, const std::string& b) {
      return std::stoll(a) < std::stoll(b);
    });
  const char* kind = index == "dataset" ? " dataset indices " : index == "stream" ? " stream positions " : " rows ";
  std::string s = std::string("; ") + what + kind;
  for (size_t i = 0; i < named.size(); ++i) s += (i ? ", " : "") + named[i];
  if (total > named.size()) s += ", ... (" + std::to_string(total) + " in all)";
  return s;
}

// The data firewall's events (action "data") of a log, summed per source,
// as timeline rows ("data" in the step column); they are no training steps.
json data_rows(const std::vector<step_event>& events) {
  constexpr size_t kRowsShown = 20;
  struct source_sum {
    data_counts d;
    int64_t events = 0;
    std::vector<std::string> dropped, changed;  // the first kRowsShown named
    size_t dropped_total = 0, changed_total = 0;
    std::string index;  // what the rows index ("" before any; "mixed" when the events differ)
  };
  std::map<std::string, source_sum> by_source;
  for (const auto& e : events) {
    if (!e.data) continue;
    source_sum& s = by_source[e.data->source.empty() ? "data firewall" : e.data->source];
    data_counts& sum = s.d;
    const data_counts& d = *e.data;
    sum.checked += d.checked, sum.dropped += d.dropped, sum.changed += d.changed, sum.repaired += d.repaired;
    sum.clipped += d.clipped, sum.nan += d.nan, sum.pos_inf += d.pos_inf, sum.neg_inf += d.neg_inf;
    sum.outliers += d.outliers, sum.raised += d.raised, ++s.events;
    if (!d.dropped_rows.empty() || !d.changed_rows.empty())
      s.index = s.index.empty() || s.index == d.row_index ? d.row_index : "mixed";
    s.dropped_total += name_data_rows(d, d.dropped_rows, kRowsShown, s.dropped);
    s.changed_total += name_data_rows(d, d.changed_rows, kRowsShown, s.changed);
  }
  json rows = json::array();
  for (const auto& [source, entry] : by_source) {
    const data_counts& d = entry.d;
    const int64_t n = entry.events;
    std::string text = source + ": " + std::to_string(d.checked) + " rows checked, " + std::to_string(d.dropped) +
                       " dropped, " + std::to_string(d.changed) + " repaired or clipped (NaN " + std::to_string(d.nan) +
                       ", +Inf " + std::to_string(d.pos_inf) + ", -Inf " + std::to_string(d.neg_inf) + ", outliers " +
                       std::to_string(d.outliers) + "; " + std::to_string(d.repaired) + " values repaired, " +
                       std::to_string(d.clipped) + " clipped)";
    if (d.raised) text += "; refused " + std::to_string(d.raised) + " times under a raise policy";
    text += listed_rows("dropped", entry.dropped, entry.dropped_total, entry.index);
    text += listed_rows("repaired or clipped", entry.changed, entry.changed_total, entry.index);
    text += " in " + std::to_string(n) + " event" + (n == 1 ? "" : "s");
    rows.push_back({{"step", "data"}, {"action", "data"}, {"skipped", false}, {"items", json::array({{"data", text}})}});
  }
  return rows;
}

// How the run ended, from its events (run_summary.h): "status", "summary"
// (the narrator's line), and the first and last steps the optimizer took
// ("final_loss": the last taken step's, not a bad step's NaN).
void add_status(const std::vector<step_event>& events, json& r) {
  run_narrator narrator;
  for (const auto& e : events) narrator.observe(e);
  const run_summary& s = narrator.summary();
  r["status"] = run_status(s);
  const std::string line = to_string(s);
  const std::string prefix = "nanguard: ";
  r["summary"] = line.rfind(prefix, 0) == 0 ? line.substr(prefix.size()) : line;
  r["first_loss"] = detail::json_number(s.first_loss);
  r["final_loss"] = detail::json_number(s.final_loss);
  r["final_step"] = s.final_step;
}

// The findings, one per failure: the same op, module, direction, role,
// culprit, rank and cause at several steps is one entry with its "count"
// and its first "steps" (kMaxSteps of them).
void add_findings(const std::vector<step_event>& events, json& r) {
  constexpr size_t kMaxSteps = 50;
  json findings = json::array();
  std::map<std::string, size_t> group_of;  // failure -> index in findings
  size_t groups = 0;
  for (const auto& e : events)
    for (const auto& f : e.findings) {
      const std::string key = fmt::format("{}|{}|{}|{}|{}|{}|{}", f.op, f.module, to_string(f.direction),
                                          to_string(f.role), f.culprit, f.rank, to_string(f.diagnosis.cause));
      const auto [it, fresh] = group_of.emplace(key, findings.size());
      if (fresh && groups++ >= kMaxFindings) continue;
      if (fresh) {
        json j = json::parse(nanguard::to_json(f));
        j["count"] = 0;
        j["steps"] = json::array();
        findings.push_back(std::move(j));
      }
      if (it->second >= findings.size()) continue;  // a group past kMaxFindings
      json& g = findings[it->second];
      g["count"] = g["count"].get<int64_t>() + 1;
      if (g["steps"].size() < kMaxSteps) g["steps"].push_back(f.step);
    }
  r["findings"] = findings;
  r["findings_omitted"] = groups - findings.size();
}

json run_json(const report_run& all) {
  // Data events are set apart: the plots and counts are of training steps.
  const bool has_data = std::any_of(all.events.begin(), all.events.end(), [](const step_event& e) { return e.data.has_value(); });
  report_run steps_only;
  if (has_data) {
    steps_only.name = all.name;
    for (const auto& e : all.events)
      if (!e.data) steps_only.events.push_back(e);
  }
  const report_run& run = has_data ? steps_only : all;
  const auto& ev = run.events;
  json r;
  r["name"] = run.name;
  r["events"] = ev.size();
  int64_t skipped = 0, rollbacks = 0;
  bool aborted = false;
  for (const auto& e : ev) {
    skipped += e.skipped ? 1 : 0;
    rollbacks += e.action == action::rollback ? 1 : 0;
    aborted = aborted || e.action == action::abort;
  }
  r["skipped"] = skipped;
  r["rollbacks"] = rollbacks;
  r["aborted"] = aborted;
  r["first_problem"] = first_problem(ev);
  add_status(ev, r);
  if (ev.empty()) {  // a log of data events only: theirs are the rows to show
    r["timeline"] = data_rows(all.events);
    r["timeline_omitted"] = 0;
    return r;
  }
  // The step axis: a log appended to by a restarted run may step back.
  const auto [lo, hi] = std::minmax_element(ev.begin(), ev.end(),
                                            [](const step_event& a, const step_event& b) { return a.step < b.step; });
  r["first_step"] = lo->step;
  r["last_step"] = hi->step;

  std::vector<int64_t> x;
  std::vector<double> loss, norm, scale, lr;
  std::vector<bool> keep;
  for (const auto& e : ev) {
    x.push_back(e.step);
    loss.push_back(e.loss);
    norm.push_back(e.grad_norm);
    scale.push_back(e.scale);
    lr.push_back(e.lr);
    keep.push_back(e.skipped);
  }
  r["series"] = {{"loss", series_json(x, loss, keep)},
                 {"grad_norm", series_json(x, norm, keep)},
                 {"scale", series_json(x, scale, keep)},
                 {"lr", series_json(x, lr, keep)}};
  json omitted;
  r["param_norms"] = parameter_series(ev, omitted);
  r["param_norms_omitted"] = omitted;
  r["skipped_ranges"] = skipped_ranges(ev);
  json rb = json::array(), aborts = json::array();
  for (const auto& e : ev) {
    if (e.action == action::rollback) rb.push_back({{"step", e.step}, {"to", e.rollback_to}});
    if (e.action == action::abort) aborts.push_back(e.step);
  }
  r["rollback_marks"] = rb;
  r["abort_marks"] = aborts;

  json timeline = data_rows(all.events);
  size_t notable_rows = timeline.size();
  for (const auto& e : ev)
    if (notable(e) && notable_rows++ < kMaxTimelineRows) timeline.push_back(timeline_row(e));
  r["timeline"] = timeline;
  r["timeline_omitted"] = notable_rows - timeline.size();
  add_findings(ev, r);
  return r;
}

// Runs in the head, before anything else: every script error and
// console.error lands in #errors (and data-errors on <body>), so a headless
// browser test can read them from the DOM.
constexpr char kErrorCapture[] = R"js(
(function () {
  var pending = [];
  function record(text) {
    var box = document.getElementById('errors');
    if (!box) { pending.push(text); return; }
    var line = document.createElement('div');
    line.className = 'error-line';
    line.textContent = text;
    box.appendChild(line);
    box.hidden = false;
    document.body.setAttribute('data-errors', String(box.childNodes.length));
  }
  window.nanguardRecordError = record;
  window.addEventListener('DOMContentLoaded', function () { pending.splice(0).forEach(record); });
  window.onerror = function (msg, src, line, col) { record('script error: ' + msg + ' (line ' + line + ':' + col + ')'); };
  window.addEventListener('unhandledrejection', function (e) { record('unhandled rejection: ' + e.reason); });
  var original = console.error;
  console.error = function () {
    record('console.error: ' + Array.prototype.slice.call(arguments).join(' '));
    return original.apply(console, arguments);
  };
})();
)js";

}  // namespace

std::string render_html_report(const std::vector<report_run>& runs, const std::string& title) {
  TORCH_CHECK(!runs.empty(), "nanguard::render_html_report: no runs to report; pass at least one report_run "
              "(e.g. {\"run\", read_events(\"events.jsonl\")})");
  json data;
  data["title"] = title;
  data["version"] = version();
  json rs = json::array();
  for (const auto& r : runs) rs.push_back(run_json(r));
  data["runs"] = std::move(rs);
  const std::string payload =
      detail::script_safe_json(data.dump(-1, ' ', false, json::error_handler_t::replace));
  const std::string t = detail::html_escape(title);

  std::string html;
  html.reserve(payload.size() + sizeof(detail::report_js) + sizeof(detail::report_css) + 2048);
  html += "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n";
  html += "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n";
  html += "<meta name=\"generator\" content=\"nanguard " + std::string(version()) + "\">\n";
  html += "<title>" + t + "</title>\n<style>\n";
  html += detail::report_css;
  html += "</style>\n<script>";
  html += kErrorCapture;
  html += "</script>\n</head>\n<body data-rendered=\"0\">\n";
  html += "<header class=\"page-header\"><h1>" + t + "</h1><p class=\"meta\" id=\"meta\"></p></header>\n";
  html += "<div id=\"errors\" class=\"errors\" hidden></div>\n";
  html += "<main id=\"report\"><noscript>This report draws its plots with JavaScript; "
          "enable it to see them.</noscript></main>\n";
  html += "<script type=\"application/json\" id=\"nanguard-data\">";
  html += payload;
  html += "</script>\n<script>\n";
  html += detail::report_js;
  html += "</script>\n</body>\n</html>\n";
  return html;
}

void write_html_report(const std::vector<report_run>& runs, const std::string& path, const std::string& title) {
  const std::string html = render_html_report(runs, title);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  TORCH_CHECK(f != nullptr, "nanguard::write_html_report: cannot open '", tmp, "' for writing: ",
              std::strerror(errno), "; check that the directory of '", path, "' exists and is writable");
  const bool written = std::fwrite(html.data(), 1, html.size(), f) == html.size();
  const int err = errno;
  const bool closed = std::fclose(f) == 0;
  if (!written || !closed) {
    std::remove(tmp.c_str());
    TORCH_CHECK(false, "nanguard::write_html_report: writing '", tmp, "' failed: ", std::strerror(err),
                "; is the disk full?");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int rerr = errno;
    std::remove(tmp.c_str());
    TORCH_CHECK(false, "nanguard::write_html_report: cannot rename '", tmp, "' to '", path, "': ",
                std::strerror(rerr), "; is '", path, "' a directory?");
  }
}

}  // namespace nanguard
