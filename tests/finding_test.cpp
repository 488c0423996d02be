// finding.h: a finding's one-line and multi-line forms, its JSON round trip
// (NaN and Inf values, every field), clear errors for bad JSON, and the
// error that carries it.
#include "nanguard/finding.h"
#include "support.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

namespace {

using nanguard::test::error_of;
using nanguard::test::kInf;
using nanguard::test::kNaN;

// A backward finding with every field set.
nanguard::finding full_finding() {
  nanguard::finding f;
  f.step = 12;
  f.op = "aten::div";
  f.caller = "aten::norm";
  f.direction = nanguard::direction::backward;
  f.node = "SqrtBackward0";
  f.forward_op = "aten::sqrt";
  f.role = nanguard::role::producer;
  f.module = "encoder.norm";
  f.culprit = "";
  nanguard::tensor_record in{"input 0", "Float", {2, 3}, {}};
  in.stats.numel = 6;
  in.stats.zeros = 2;
  in.stats.finite = 6;
  in.stats.min = 0;
  in.stats.max = 4;
  nanguard::tensor_record out{"output 0", "Float", {2, 3}, {}};
  out.stats.numel = 6;
  out.stats.pos_inf = 2;
  out.stats.finite = 4;
  out.stats.first_nonfinite_index = 1;
  out.stats.first_nonfinite_value = kInf;
  f.inputs = {in};
  f.outputs = {out};
  f.index = 1;
  f.value = kInf;
  f.thread = 7;
  f.sequence_nr = 42;
  f.rank = 3;
  return f;
}

TEST(finding, one_line_names_step_rank_direction_op_node_module_role_and_element) {
  EXPECT_EQ("step 12 rank 3 backward aten::div (SqrtBackward0 of aten::sqrt) in encoder.norm: producer, "
            "output 0 [0, 1] = inf",
            nanguard::to_string(full_finding()));
  nanguard::finding f;
  f.op = "aten::addmm";
  f.role = nanguard::role::input;
  f.culprit = "batch[0]";
  f.value = kNaN;
  EXPECT_EQ("step -1 forward aten::addmm: input from batch[0], output 0 [-1] = nan", nanguard::to_string(f));
}

TEST(finding, text_holds_every_part_and_the_census_of_each_tensor) {
  const std::string text = nanguard::to_text(full_finding());
  for (const char* part : {"non-finite value at step 12 on rank 3", "aten::div (backward, inside aten::norm)",
                           "SqrtBackward0 (created by forward aten::sqrt)", "encoder.norm", "producer",
                           "output 0 [0, 1] (flat index 1) = inf", "input 0:", "Float [2, 3]", "zero=2", "+inf=2", "cause:"})
    EXPECT_NE(std::string::npos, text.find(part)) << part << " not in:\n" << text;
}

TEST(finding, one_line_starts_with_the_user_s_line_when_known) {
  nanguard::finding f = full_finding();
  f.source = {"/home/me/train.py", 42, "forward"};
  EXPECT_EQ("/home/me/train.py:42 (forward): step 12 rank 3 backward aten::div (SqrtBackward0 of aten::sqrt) in "
            "encoder.norm: producer, output 0 [0, 1] = inf",
            nanguard::to_string(f));
  EXPECT_NE(std::string::npos, nanguard::to_text(f).find("  source:    /home/me/train.py:42 (forward)\n"));
}

TEST(finding, element_position_counts_rows_then_columns) {
  nanguard::finding f = full_finding();  // output 0 is [2, 3]
  f.index = 5;
  EXPECT_EQ((std::vector<int64_t>{1, 2}), nanguard::element_position(f));
  f.outputs[0].shape = {2, 0, 3};  // no element: the flat index alone
  EXPECT_EQ((std::vector<int64_t>{5}), nanguard::element_position(f));
  f.outputs.clear();
  EXPECT_EQ((std::vector<int64_t>{5}), nanguard::element_position(f));
}

TEST(finding, json_round_trips_every_field_nan_and_inf_included) {
  nanguard::finding f = full_finding();
  f.source = {"/home/me/train.py", 42, "forward"};
  const nanguard::finding back = nanguard::finding_from_json(nanguard::to_json(f));
  EXPECT_EQ(nanguard::to_json(f), nanguard::to_json(back));
  EXPECT_EQ("/home/me/train.py:42 (forward)", nanguard::to_string(back.source));
  EXPECT_EQ(f.caller, back.caller);
  EXPECT_EQ(f.sequence_nr, back.sequence_nr);
  EXPECT_EQ(f.rank, back.rank);
  EXPECT_TRUE(std::isinf(back.value) && back.value > 0);
  ASSERT_EQ(1u, back.outputs.size());
  EXPECT_EQ(2, back.outputs[0].stats.pos_inf);
  EXPECT_EQ((std::vector<int64_t>{2, 3}), back.inputs[0].shape);
  nanguard::finding nan = f;
  nan.value = kNaN;
  EXPECT_TRUE(std::isnan(nanguard::finding_from_json(nanguard::to_json(nan)).value));
}

TEST(finding, bad_json_is_an_error_naming_what_is_wrong) {
  EXPECT_NE(std::string::npos, error_of([] { nanguard::finding_from_json("{not json"); }).find("finding"));
  const std::string msg = error_of([] { nanguard::finding_from_json(R"({"step": "twelve", "op": "aten::div"})"); });
  EXPECT_NE(std::string::npos, msg.find("'step'")) << msg;
  std::string json = nanguard::to_json(full_finding());
  json.replace(json.find("\"producer\""), 10, "\"villain\"");
  const std::string role = error_of([&] { nanguard::finding_from_json(json); });
  EXPECT_NE(std::string::npos, role.find("'role' is 'villain'; expected")) << role;  // it read as "input"
  json = nanguard::to_json(full_finding());
  json.replace(json.find("\"backward\""), 10, "\"sideways\"");
  const std::string direction = error_of([&] { nanguard::finding_from_json(json); });
  EXPECT_NE(std::string::npos, direction.find("'direction' is 'sideways'")) << direction;  // it read as "forward"
}

TEST(finding, nonfinite_error_carries_the_finding_and_says_it) {
  const nanguard::nonfinite_error e(full_finding());
  EXPECT_EQ("aten::div", e.finding().op);
  EXPECT_NE(std::string::npos, std::string(e.what()).find(nanguard::to_string(full_finding()))) << e.what();
}

}  // namespace

TEST(finding, direction_and_role_names_round_trip_and_a_wrong_one_lists_them) {
  for (nanguard::direction d : nanguard::all_directions)
    EXPECT_EQ(d, nanguard::direction_from_string(nanguard::to_string(d)));
  for (nanguard::role r : nanguard::all_roles) EXPECT_EQ(r, nanguard::role_from_string(nanguard::to_string(r)));
  EXPECT_EQ(error_of([] { nanguard::role_from_string("villain"); }),
            "nanguard::role_from_string: role must be one of 'producer', 'propagator', 'input' but is 'villain'");
}
