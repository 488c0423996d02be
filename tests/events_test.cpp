#include "nanguard/events.h"
#include "support.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using nanguard::test::error_of;

TEST(events, round_trip_keeps_nan_inf_spikes_and_findings) {
  nanguard::step_event e;
  e.step = 12;
  e.loss = NAN;
  e.grad_norm = INFINITY;
  e.scale = 1024;
  e.lr = 3e-4;
  e.skipped = true;
  e.action = nanguard::action::rollback;
  e.reason = "non-finite gradient";
  e.spikes = {{"loss", 9.5, 11.2}};
  e.nonfinite_params = {{"encoder.0.weight", 3}};
  e.verdict = nanguard::verdict::reproduced;
  nanguard::finding f;
  f.step = 12;
  f.op = "aten::div";
  f.module = "norm";
  f.value = NAN;
  f.index = 4;
  f.rank = 1;
  f.diagnosis = {nanguard::cause::division_by_zero, "x/0: 2 of 8 denominators are exactly 0", "add eps",
                 nanguard::confidence::high};
  e.findings = {f};
  e.rollback_to = 10;
  e.remedy = "rolled back to the snapshot of step 10; lr 0.0006 -> 0.0003";
  e.top_norms = {{"head.weight", 7.5}, {"encoder.0.weight", NAN}};
  e.rank = 0;
  e.nonfinite_ranks = {1, 3};
  e.guard_ms = 0.75;
  const std::string line = nanguard::to_json(e);
  EXPECT_EQ(std::string::npos, line.find('\n'));
  const auto back = nanguard::step_event_from_json(line);
  EXPECT_EQ(12, back.step);
  EXPECT_TRUE(std::isnan(back.loss));
  EXPECT_TRUE(std::isinf(back.grad_norm));
  EXPECT_EQ(1024, back.scale);
  EXPECT_EQ(3e-4, back.lr);
  EXPECT_TRUE(back.skipped);
  EXPECT_EQ(nanguard::action::rollback, back.action);
  EXPECT_EQ("non-finite gradient", back.reason);
  ASSERT_EQ(1u, back.spikes.size());
  EXPECT_EQ("loss", back.spikes[0].series);
  ASSERT_EQ(1u, back.nonfinite_params.size());
  EXPECT_EQ("encoder.0.weight", back.nonfinite_params[0].name);
  EXPECT_EQ(3, back.nonfinite_params[0].nonfinite);
  EXPECT_EQ(nanguard::verdict::reproduced, back.verdict);
  ASSERT_EQ(1u, back.findings.size());
  EXPECT_EQ("aten::div", back.findings[0].op);
  EXPECT_EQ("norm", back.findings[0].module);
  EXPECT_EQ(4, back.findings[0].index);
  EXPECT_EQ(10, back.rollback_to);
  EXPECT_EQ(0.75, back.guard_ms);
  EXPECT_EQ(1, back.findings[0].rank);
  EXPECT_EQ(nanguard::cause::division_by_zero, back.findings[0].diagnosis.cause);
  EXPECT_EQ("x/0: 2 of 8 denominators are exactly 0", back.findings[0].diagnosis.evidence);
  EXPECT_EQ("add eps", back.findings[0].diagnosis.remedy);
  EXPECT_EQ(nanguard::confidence::high, back.findings[0].diagnosis.confidence);
  EXPECT_EQ(e.remedy, back.remedy);
  EXPECT_EQ("", nanguard::step_event_from_json(R"({"step":1,"action":"step"})").remedy) << "an older line";
  ASSERT_EQ(2u, back.top_norms.size());
  EXPECT_EQ("head.weight", back.top_norms[0].first);
  EXPECT_EQ(7.5, back.top_norms[0].second);
  EXPECT_TRUE(std::isnan(back.top_norms[1].second));
  EXPECT_EQ(0, back.rank);
  EXPECT_EQ((std::vector<int64_t>{1, 3}), back.nonfinite_ranks);
}

// Every action and verdict reads back from its one name; an unknown name
// is an error listing the valid ones.
TEST(events, actions_and_verdicts_read_back_from_their_names) {
  for (nanguard::action a : nanguard::all_actions) EXPECT_EQ(a, nanguard::action_from_string(nanguard::to_string(a)));
  for (nanguard::verdict v : nanguard::all_verdicts)
    EXPECT_EQ(v, nanguard::verdict_from_string(nanguard::to_string(v)));
  EXPECT_STREQ("compiled only", nanguard::to_string(nanguard::verdict::compiled_only));
  EXPECT_EQ(error_of([] { nanguard::action_from_string("jump"); }),
            "nanguard::action_from_string: action must be one of 'step', 'skip', 'backoff', 'rollback', 'abort', "
            "'data' but is 'jump'");
  EXPECT_NE(error_of([] { nanguard::verdict_from_string("maybe"); })
                .find("verdict must be one of '', 'reproduced', 'not reproduced', 'replay failed', 'compiled only'"),
            std::string::npos);
  EXPECT_NE(error_of([] { nanguard::step_event_from_json(R"({"step": 1, "action": "jump"})"); })
                .find("action must be one of"),
            std::string::npos);
}

// A data event has its own axis (data.check) and no training fields; a line
// written before that (its check as "step") still reads.
TEST(events, a_data_event_has_its_own_axis_and_no_loss) {
  nanguard::step_event e;
  e.action = nanguard::action::data;
  e.data = nanguard::data_counts{};
  e.data->source = "FirewallDataset";
  e.data->check = 12;
  e.data->checked = 40;
  e.data->dropped = 1;
  e.data->dropped_rows = {1234};
  e.data->row_index = "dataset";
  const json j = json::parse(nanguard::to_json(e));
  EXPECT_FALSE(j.contains("loss")) << j.dump();
  EXPECT_FALSE(j.contains("step")) << j.dump();
  EXPECT_EQ(j.at("data").at("check"), 12);
  EXPECT_EQ(j.at("data").at("dropped_rows"), json::array({1234}));
  EXPECT_EQ(j.at("data").at("row_index"), "dataset");
  const nanguard::step_event back = nanguard::step_event_from_json(j.dump());
  ASSERT_TRUE(back.data);
  EXPECT_EQ(12, back.data->check);
  EXPECT_EQ(std::vector<int64_t>{1234}, back.data->dropped_rows);
  EXPECT_EQ("dataset", back.data->row_index);
  const nanguard::step_event old = nanguard::step_event_from_json(
      R"({"step": 7, "action": "data", "data": {"source": "firewall_collate", "checked": 32, "dropped": 2}})");
  ASSERT_TRUE(old.data);
  EXPECT_EQ(7, old.data->check);
  EXPECT_EQ(0, old.step);
  EXPECT_EQ("batch", old.data->row_index);
}

TEST(events, each_line_is_on_disk_as_soon_as_it_is_written) {
  const fs::path p = fs::temp_directory_path() / ("nanguard_events_" + std::to_string(::getpid()) + ".jsonl");
  fs::remove(p);
  nanguard::event_log log(p.string());
  for (int i = 1; i <= 3; ++i) {
    nanguard::step_event e;
    e.step = i;
    log.write(e);
    // Read through another handle while the log is still open.
    const auto events = nanguard::read_events(p.string());
    ASSERT_EQ(size_t(i), events.size());
    EXPECT_EQ(i, events.back().step);
  }
  fs::remove(p);
}

TEST(events, errors_say_what_is_wrong) {
  try {
    nanguard::step_event_from_json("{\"loss\": 1}");
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("'step' is missing"));
  }
  try {
    nanguard::step_event_from_json("{\"step\": 1, \"action\": \"step\", \"top_norms\": [{\"name\": \"w\", \"norm\": true}]}");
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("'norm' should be a number"));
    EXPECT_EQ(std::string::npos, std::string(e.what()).find("json.exception"));
  }
  try {
    nanguard::step_event_from_json("{\"step\": \"one\", \"action\": \"step\"}");
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("'step' should be an integer but is a string")) << e.what();
  }
  try {
    nanguard::step_event_from_json("not json");
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("not JSON"));
  }
  try {
    nanguard::read_events("/nonexistent/events.jsonl");
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("cannot open event log '/nonexistent/events.jsonl'"));
  }
}

TEST(events, a_malformed_line_is_named_with_its_file_and_number) {
  const std::string path = ::testing::TempDir() + "events_bad_line.jsonl";
  std::ofstream(path) << "{\"step\": 1, \"action\": \"step\"}\n\n{\"step\": \"two\", \"action\": \"step\"}\n";
  try {
    nanguard::read_events(path);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find(path + ":3: not a step event")) << e.what();
  }
}

TEST(events, a_malformed_line_is_quoted_without_its_control_bytes) {
  // An escape sequence in the line, or in a string of it, cleared the user's terminal.
  const std::string path = ::testing::TempDir() + "events_control_bytes.jsonl";
  std::ofstream(path) << "garbage\x1b[2J\x07here\n";
  std::string msg = error_of([&] { nanguard::read_events(path); });
  EXPECT_NE(msg.find("garbage\\x1b[2J\\x07here"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\x1b'), std::string::npos) << msg;
  std::ofstream(path) << "{\"step\": 1, \"action\": \"\\u001b[31mred\"}\n";
  msg = error_of([&] { nanguard::read_events(path); });
  EXPECT_NE(msg.find("but is '\\x1b[31mred'"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\x1b'), std::string::npos) << msg;
}

}  // namespace
