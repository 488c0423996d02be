#include <nanguard/report.h>

#include <nanguard/diagnosis.h>  // diagnose(): the findings of the runs reported
#include "detail/report_detail.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <unistd.h>

namespace {

using nanguard::report_run;
using nanguard::step_event;
using json = nlohmann::json;
namespace fs = std::filesystem;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + what.size())) ++n;
  return n;
}

// The JSON the page embeds, parsed back.
json payload(const std::string& html) {
  const std::string open = "<script type=\"application/json\" id=\"nanguard-data\">";
  const size_t begin = html.find(open);
  EXPECT_NE(begin, std::string::npos);
  const size_t start = begin + open.size();
  const size_t end = html.find("</script>", start);
  EXPECT_NE(end, std::string::npos);
  return json::parse(html.substr(start, end - start));
}

std::vector<step_event> healthy_run(int64_t steps) {
  std::vector<step_event> events;
  for (int64_t s = 1; s <= steps; ++s) {
    step_event e;
    e.step = s;
    e.loss = 2.0 / std::sqrt(double(s)) + 0.01 * std::sin(double(s));
    e.grad_norm = 1.0 + 0.5 * std::cos(double(s) / 7.0);
    e.scale = 65536;
    e.lr = 1e-3 * std::min(1.0, double(s) / 100.0);
    e.top_norms = {{"encoder.weight", e.grad_norm * 0.8}, {"head.weight", e.grad_norm * 0.3}};
    events.push_back(e);
  }
  return events;
}

nanguard::finding sample_finding(const std::string& module) {
  nanguard::finding f;
  f.step = 3;
  f.op = "aten::div";
  f.module = module;
  f.direction = nanguard::direction::forward;
  f.role = nanguard::role::producer;
  f.index = 12;
  f.value = kNaN;
  nanguard::tensor_record in;
  in.name = "input 0";
  in.dtype = "Float";
  in.shape = {8, 4};
  in.stats.numel = 32;
  in.stats.finite = 32;
  in.stats.zeros = 4;
  in.stats.min = 0;
  in.stats.max = 1;
  f.inputs.push_back(in);
  nanguard::tensor_record out = in;
  out.name = "output 0";
  out.stats.nan = 4;
  out.stats.finite = 28;
  f.outputs.push_back(out);
  return f;
}

TEST(report, downsample_keeps_every_point_of_a_short_series) {
  const std::vector<double> y = {1, 2, kNaN, 4};
  const auto idx = nanguard::detail::downsample_indices(y, {}, 2000);
  EXPECT_EQ(idx, (std::vector<size_t>{0, 1, 2, 3}));
}

TEST(report, downsample_keeps_extremes_nonfinite_and_flagged_points) {
  const size_t n = 100000, max_points = 2000;
  std::vector<double> y(n);
  std::vector<bool> keep(n, false);
  for (size_t i = 0; i < n; ++i) y[i] = std::sin(double(i) * 0.001) + 1e-6 * double(i % 97);
  y[123] = -50;     // global min
  y[77777] = 900;   // global max
  y[5000] = kNaN;
  y[5001] = kInf;
  y[99998] = -kInf;
  keep[424] = keep[60001] = true;
  const auto idx = nanguard::detail::downsample_indices(y, keep, max_points);
  EXPECT_LE(idx.size(), max_points + 2 + 5);
  EXPECT_GE(idx.size(), max_points / 2);
  EXPECT_TRUE(std::is_sorted(idx.begin(), idx.end()));
  EXPECT_EQ(std::set<size_t>(idx.begin(), idx.end()).size(), idx.size());
  const std::set<size_t> got(idx.begin(), idx.end());
  for (size_t must : {size_t(0), size_t(123), size_t(77777), size_t(5000), size_t(5001), size_t(99998), size_t(424),
                      size_t(60001), n - 1})
    EXPECT_TRUE(got.count(must)) << "index " << must << " was dropped";
  // Every bucket still shows its range: the largest value of each stretch survives.
  const size_t buckets = max_points / 2;
  for (size_t b = 0; b < buckets; b += 97) {
    const size_t lo = b * n / buckets, hi = (b + 1) * n / buckets;
    size_t imax = lo;
    for (size_t i = lo; i < hi; ++i)
      if (std::isfinite(y[i]) && !keep[i] && (!std::isfinite(y[imax]) || y[i] > y[imax])) imax = i;
    EXPECT_TRUE(got.count(imax)) << "bucket " << b << " lost its maximum";
  }
}

// An internal invariant (the report builds both from the same events): an internal assert.
TEST(report, downsample_rejects_flags_of_another_length) {
  try {
    nanguard::detail::downsample_indices({1, 2, 3}, {true}, 10);
    FAIL() << "expected c10::Error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("INTERNAL ASSERT FAILED"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("keep has 1 flags for 3 points (a bug in nanguard"), std::string::npos)
        << e.what();
  }
}

TEST(report, escapes_for_html_and_script) {
  EXPECT_EQ(nanguard::detail::html_escape("<b a=\"1\">&'"), "&lt;b a=&quot;1&quot;&gt;&amp;&#39;");
  const std::string j = json{{"m", "</script><!--"}}.dump();
  const std::string safe = nanguard::detail::script_safe_json(j);
  EXPECT_EQ(safe.find('<'), std::string::npos);
  EXPECT_EQ(json::parse(safe).at("m"), "</script><!--");
}

TEST(report, a_module_name_cannot_close_the_script) {
  const std::string evil = "enc</script><script>window.pwned=1</script><!--";
  std::vector<step_event> events = healthy_run(5);
  events[2].loss = kNaN;
  events[2].skipped = true;
  events[2].action = nanguard::action::skip;
  events[2].findings.push_back(sample_finding(evil));
  events[2].note = "</SCRIPT> in a note";
  const std::string html = nanguard::render_html_report({{"run </script>", events}}, "t </script> & <b>");
  // Exactly the page's own three scripts end; no text from the data does.
  EXPECT_EQ(count(html, "</script>"), 3u);
  EXPECT_EQ(html.find("<script>window.pwned"), std::string::npos);
  EXPECT_EQ(html.find("</SCRIPT>"), std::string::npos);
  EXPECT_NE(html.find("<title>t &lt;/script&gt; &amp; &lt;b&gt;</title>"), std::string::npos);
  const json data = payload(html);
  EXPECT_EQ(data.at("runs").at(0).at("name"), "run </script>");
  EXPECT_EQ(data.at("runs").at(0).at("findings").at(0).at("module"), evil);
  EXPECT_EQ(data.at("title"), "t </script> & <b>");
}

TEST(report, summary_timeline_and_findings) {
  std::vector<step_event> events = healthy_run(40);
  events[9].loss = kInf;
  events[9].grad_norm = kNaN;
  events[9].skipped = true;
  events[9].action = nanguard::action::backoff;
  events[9].nonfinite_params = {{"encoder.weight", 7}};
  events[9].verdict = nanguard::verdict::reproduced;
  events[9].findings.push_back(sample_finding("encoder.norm"));
  events[9].findings.back().diagnosis = nanguard::diagnose(events[9].findings.back());
  events[9].remedy = "skipped the step; loss scale 65536 -> 32768";
  events[19].skipped = true;
  events[19].action = nanguard::action::rollback;
  events[19].rollback_to = 15;
  events[20].skipped = true;
  events[20].action = nanguard::action::skip;
  events[30].spikes.push_back({"loss", 9.5, 6.2});
  const std::string html = nanguard::render_html_report({{"a", events}, {"empty", {}}});
  const json data = payload(html);
  const json& a = data.at("runs").at(0);
  EXPECT_EQ(a.at("events"), 40);
  EXPECT_EQ(a.at("skipped"), 3);
  EXPECT_EQ(a.at("rollbacks"), 1);
  EXPECT_EQ(a.at("aborted"), false);
  EXPECT_EQ(a.at("first_problem"), "step 3 forward aten::div in encoder.norm: producer, output 0 [3, 0] = nan");
  EXPECT_EQ(a.at("skipped_ranges"), json::parse("[[10,10],[20,21]]"));
  EXPECT_EQ(a.at("rollback_marks"), json::parse("[{\"step\":20,\"to\":15}]"));
  ASSERT_EQ(a.at("timeline").size(), 4u);  // steps 10, 20, 21, 31
  EXPECT_EQ(a.at("timeline").at(0).at("action"), "backoff");
  EXPECT_EQ(a.at("timeline").at(3).at("items").at(0).at(1), "loss spike: 9.5 (z = 6.2)");
  // Non-finite points are embedded as "nan"/"inf", not dropped.
  EXPECT_EQ(a.at("series").at("loss").at("y").at(9), "inf");
  EXPECT_EQ(a.at("series").at("grad_norm").at("y").at(9), "nan");
  ASSERT_EQ(a.at("param_norms").size(), 2u);
  EXPECT_EQ(a.at("param_norms").at(0).at("name"), "encoder.weight");
  EXPECT_EQ(a.at("findings").at(0).at("outputs").at(0).at("stats").at("nan"), 4);
  // Each finding with its cause and remedy; the bad step with the remedy applied.
  EXPECT_EQ(a.at("findings").at(0).at("diagnosis").at("cause"), "division_by_zero");
  EXPECT_NE(a.at("findings").at(0).at("diagnosis").at("remedy").get<std::string>().find("eps"), std::string::npos);
  const json& bad_step = a.at("timeline").at(0).at("items");
  EXPECT_NE(bad_step.dump().find("(likely cause: division_by_zero)"), std::string::npos) << bad_step.dump();
  EXPECT_NE(bad_step.dump().find("[\"remedy\",\"skipped the step; loss scale 65536 -> 32768\"]"), std::string::npos)
      << bad_step.dump();
  EXPECT_EQ(a.at("status"), "recovered");
  EXPECT_EQ(a.at("final_step"), 40);
  const json& empty = data.at("runs").at(1);
  EXPECT_EQ(empty.at("events"), 0);
  EXPECT_EQ(empty.at("status"), "empty");
  EXPECT_FALSE(empty.contains("series"));
}

// The status of a run whose events are `events`, and its summary line.
std::pair<std::string, std::string> status_of(const std::vector<step_event>& events) {
  const json run = payload(nanguard::render_html_report({{"run", events}})).at("runs").at(0);
  return {run.at("status").get<std::string>(), run.at("summary").get<std::string>()};
}

void make_bad(step_event& e, nanguard::action a) {
  e.loss = kNaN;
  e.skipped = true;
  e.action = a;
  e.reason = "non-finite loss";
}

TEST(report, the_status_says_how_the_run_ended_not_only_whether_it_was_finite) {
  std::vector<step_event> events = healthy_run(40);
  EXPECT_EQ(status_of(events).first, "finite");
  make_bad(events[5], nanguard::action::skip);
  const auto [skipped_status, skipped_summary] = status_of(events);
  EXPECT_EQ(skipped_status, "recovered");
  EXPECT_EQ(skipped_summary, "40 steps, 1 not taken (1 skipped); last bad step 6 [non-finite loss]; "
                             "loss 2.008 (step 1) -> 0.3237 (step 40); loss scale 65536");
  // Finite, but it ended far above its start: not "recovered".
  std::vector<step_event> diverged = events;
  diverged.back().loss = 3e36;
  const auto [status, summary] = status_of(diverged);
  EXPECT_EQ(status, "unrecovered");
  EXPECT_NE(summary.find("-> 3e+36 (step 40), not below the first"), std::string::npos) << summary;
  // Its last steps (40 / 10 = 4 of them) all bad: it did not end finite.
  std::vector<step_event> ended_bad = events;
  for (size_t i = 36; i < 40; ++i) make_bad(ended_bad[i], nanguard::action::skip);
  EXPECT_EQ(status_of(ended_bad).first, "nonfinite");
  // Rolled back to the initial weights at the end: it says so.
  std::vector<step_event> reset = events;
  make_bad(reset.back(), nanguard::action::rollback);
  reset.back().rollback_to = 0;
  const auto [reset_status, reset_summary] = status_of(reset);
  EXPECT_EQ(reset_status, "unrecovered");
  EXPECT_NE(reset_summary.find("; ended on its initial weights (rolled back to before step 1)"), std::string::npos)
      << reset_summary;
  std::vector<step_event> stopped = events;
  make_bad(stopped.back(), nanguard::action::abort);
  EXPECT_EQ(status_of(stopped).first, "nonfinite");
}

TEST(report, the_same_finding_at_many_steps_is_one_entry_with_its_count_and_steps) {
  std::vector<step_event> events = healthy_run(40);
  for (int64_t s = 10; s <= 30; ++s) {
    step_event& e = events[size_t(s - 1)];
    make_bad(e, nanguard::action::skip);
    e.findings.push_back(sample_finding("encoder.norm"));
    e.findings.back().step = s;
  }
  events[34].findings.push_back(sample_finding("decoder.norm"));
  const json run = payload(nanguard::render_html_report({{"run", events}})).at("runs").at(0);
  ASSERT_EQ(run.at("findings").size(), 2u);
  const json& same = run.at("findings").at(0);
  EXPECT_EQ(same.at("module"), "encoder.norm");
  EXPECT_EQ(same.at("count"), 21);
  EXPECT_EQ(same.at("steps").size(), 21u);
  EXPECT_EQ(same.at("steps").at(0), 10);
  EXPECT_EQ(same.at("steps").at(20), 30);
  EXPECT_EQ(run.at("findings").at(1).at("count"), 1);
  EXPECT_EQ(run.at("findings_omitted"), 0);
}

TEST(report, a_finding_shows_the_remedies_tried_and_the_verified_one) {
  std::vector<step_event> events = healthy_run(10);
  step_event& bad = events[4];
  make_bad(bad, nanguard::action::skip);
  bad.findings.push_back(sample_finding("encoder.norm"));
  nanguard::finding& f = bad.findings.back();
  f.diagnosis = nanguard::diagnose(f);
  f.remedy_checks.push_back({nanguard::remedy_kind::float32, "aten::div in float32",
                             nanguard::check_result::still_nonfinite, kNaN, "step 3 forward aten::div: nan"});
  f.remedy_checks.push_back({nanguard::remedy_kind::denominator_eps, "eps 1e-05 on the zero denominators of aten::div",
                             nanguard::check_result::finite, 0.52, ""});
  const std::string html = nanguard::render_html_report({{"run", events}});
  const json run = payload(html).at("runs").at(0);
  // The finding's card draws each check (report.js: remedyChecksBlock), the verified one highlighted.
  const json& checks = run.at("findings").at(0).at("remedy_checks");
  ASSERT_EQ(checks.size(), 2u);
  EXPECT_EQ(checks.at(0).at("result"), "still_nonfinite");
  EXPECT_EQ(checks.at(0).at("loss"), "nan");
  EXPECT_EQ(checks.at(1).at("result"), "finite");
  EXPECT_EQ(checks.at(1).at("applied"), "eps 1e-05 on the zero denominators of aten::div");
  EXPECT_NE(html.find("remedyChecksBlock(f.remedy_checks)"), std::string::npos);
  EXPECT_NE(html.find(".remedy-checks .verified"), std::string::npos);
  // The bad step's row in the timeline names the verified remedy.
  const json& items = run.at("timeline").at(0).at("items");
  EXPECT_NE(items.dump().find("[\"verified\",\"eps 1e-05 on the zero denominators of aten::div keeps the step finite "
                              "(replayed loss 0.52)\"]"),
            std::string::npos)
      << items.dump();
}

// A data event as nanguard.data writes it: `check` of `source`, dropping `dropped`.
step_event data_event(const std::string& source, int64_t check, int64_t checked, std::vector<int64_t> dropped,
                      const std::string& row_index) {
  step_event e;
  e.action = nanguard::action::data;
  e.data = nanguard::data_counts{};
  e.data->source = source;
  e.data->check = check;
  e.data->checked = checked;
  e.data->dropped = int64_t(dropped.size());
  e.data->nan = int64_t(dropped.size());
  e.data->dropped_rows = std::move(dropped);
  e.data->row_index = row_index;
  return e;
}

TEST(report, a_log_of_data_events_only_shows_them_with_their_rows) {
  const std::vector<step_event> events = {data_event("FirewallDataset", 4, 4, {3}, "dataset"),
                                          data_event("FirewallDataset", 41, 37, {40}, "dataset"),
                                          data_event("FirewallDataset", 64, 23, {}, "dataset"),
                                          data_event("firewall_collate", 2, 16, {5}, "batch")};
  const json run = payload(nanguard::render_html_report({{"data", events}})).at("runs").at(0);
  EXPECT_EQ(run.at("events"), 0);
  ASSERT_EQ(run.at("timeline").size(), 2u) << run.dump();
  const std::string dataset = run.at("timeline").at(0).at("items").at(0).at(1);
  EXPECT_NE(dataset.find("FirewallDataset: 64 rows checked, 2 dropped"), std::string::npos) << dataset;
  EXPECT_NE(dataset.find("dropped dataset indices 3, 40"), std::string::npos) << dataset;
  const std::string collate = run.at("timeline").at(1).at("items").at(0).at(1);
  EXPECT_NE(collate.find("dropped rows 5 of check 2"), std::string::npos) << collate;
}

TEST(report, a_long_run_is_downsampled_but_keeps_its_bad_steps) {
  std::vector<step_event> events = healthy_run(100000);
  events[49999].loss = kNaN;
  events[49999].skipped = true;
  events[49999].action = nanguard::action::skip;
  const auto start = std::chrono::steady_clock::now();
  const std::string html = nanguard::render_html_report({{"long", events}});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 5.0);
  EXPECT_LT(html.size(), 2u << 20) << "the page should stay small";
  const json run = payload(html).at("runs").at(0);
  const json& loss = run.at("series").at("loss");
  EXPECT_EQ(loss.at("points"), 100000);
  EXPECT_LE(loss.at("x").size(), 2010u);
  bool kept = false;
  for (size_t i = 0; i < loss.at("x").size(); ++i)
    if (loss.at("x").at(i) == 50000) kept = loss.at("y").at(i) == "nan";
  EXPECT_TRUE(kept) << "the skipped NaN step 50000 must be plotted";
  EXPECT_EQ(run.at("skipped_ranges"), json::parse("[[50000,50000]]"));
  EXPECT_LE(run.at("param_norms").at(0).at("x").size(), 2010u);
}

TEST(report, the_step_axis_covers_a_log_that_steps_back) {
  std::vector<step_event> events = healthy_run(6);
  const int64_t steps[] = {10, 11, 12, 1, 2, 3};  // a run restarted, appending to the same log
  for (size_t i = 0; i < events.size(); ++i) events[i].step = steps[i];
  const json run = payload(nanguard::render_html_report({{"restarted", events}})).at("runs").at(0);
  EXPECT_EQ(run.at("first_step"), 1);
  EXPECT_EQ(run.at("last_step"), 12);
  EXPECT_EQ(run.at("series").at("loss").at("x").size(), 6u);
}

TEST(report, needs_a_run) {
  try {
    nanguard::render_html_report({});
    FAIL() << "expected c10::Error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no runs to report"), std::string::npos) << e.what();
  }
}

TEST(report, writes_atomically_and_names_a_bad_path) {
  const fs::path dir = fs::temp_directory_path() / ("nanguard_report_test_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string path = (dir / "report.html").string();
  nanguard::write_html_report({{"a", healthy_run(3)}}, path, "three steps");
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  EXPECT_NE(text.str().find("<title>three steps</title>"), std::string::npos);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1) << "a temporary file was left";
  const std::string bad = (dir / "missing" / "report.html").string();
  try {
    nanguard::write_html_report({{"a", healthy_run(3)}}, bad);
    FAIL() << "expected c10::Error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("exists and is writable"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

}  // namespace
