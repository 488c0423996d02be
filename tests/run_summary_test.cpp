// What a guarded run tells its user: a warning line per bad step, short for
// a repeat, and the summary; from events, and from a verbose guard's stderr.
#include "nanguard/guard.h"
#include "nanguard/run_summary.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sstream>

namespace {

using nanguard::action;
using nanguard::run_narrator;
using nanguard::step_event;

step_event taken(int64_t step, double loss) {
  step_event e;
  e.step = step;
  e.loss = loss;
  return e;
}

step_event bad(int64_t step, action a, const std::string& remedy) {
  step_event e;
  e.step = step;
  e.loss = NAN;
  e.skipped = true;
  e.action = a;
  e.reason = "non-finite gradient";
  e.nonfinite_params = {{"fc.weight", 3}, {"fc.bias", 1}};
  e.remedy = remedy;
  return e;
}

// The lines of `text` that start with "nanguard: " (what the guard printed).
std::vector<std::string> guard_lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.rfind("nanguard: ", 0) == 0) out.push_back(line);
  return out;
}

TEST(run_summary, a_bad_step_is_one_line_and_its_repeats_say_how_often) {
  run_narrator n;
  EXPECT_EQ(n.observe(taken(1, 2.0)), "");
  EXPECT_EQ(n.observe(bad(2, action::skip, "skipped the step")),
            "nanguard: step 2: non-finite gradient in fc.weight and 1 more parameters: skipped the step");
  EXPECT_EQ(n.observe(bad(3, action::skip, "skipped the step")),
            "nanguard: step 3: non-finite gradient in fc.weight and 1 more parameters again (2nd time): skipped the step");
  EXPECT_EQ(n.last_warning(), nanguard::warning_line(bad(3, action::skip, "skipped the step"), 2));
  for (auto [times, word] : {std::pair{3, "3rd"}, {11, "11th"}, {12, "12th"}, {13, "13th"}, {21, "21st"}, {22, "22nd"}})
    EXPECT_NE(nanguard::warning_line(bad(9, action::skip, "x"), times).find(std::string("again (") + word + " time)"),
              std::string::npos);
  step_event data;
  data.action = action::data;
  EXPECT_EQ(n.observe(data), "");
  EXPECT_EQ(n.summary().steps, 3);  // the data event is no step
}

// A NaN only the compiled code makes has no finding to take a remedy from:
// the first line ends with the bisection's note (stage, kernel, remedy).
TEST(run_summary, a_nan_only_compiled_code_makes_is_told_with_its_kernel_and_remedy) {
  step_event e = bad(5, action::skip, "skipped the step");
  e.reason = "non-finite loss";
  e.nonfinite_params.clear();
  e.verdict = nanguard::verdict::compiled_only;
  e.note = "compiled only: the eager step and the aot_eager graph are finite; Inductor's kernel cpp_fused_log_0 "
           "made the NaN/Inf; remedy: run that part of the model eagerly";
  EXPECT_EQ(nanguard::warning_line(e),
            "nanguard: step 5: non-finite loss (only in the compiled code): skipped the step; " + e.note);
  EXPECT_EQ(nanguard::warning_line(e, 2),
            "nanguard: step 5: non-finite loss (only in the compiled code) again (2nd time): skipped the step");
}

// A finite step rolled back because its loss ran away: no op is named, and
// the line says what to change (the rollback's LR cut lasts one run).
TEST(run_summary, a_runaway_step_is_told_with_the_lr_remedy) {
  step_event e = taken(2, 8.7);
  e.skipped = true;
  e.action = action::rollback;
  e.reason = "loss diverging from the start: 8.7 is over 10 times the first loss (0.73)";
  e.remedy = "rolled back to the snapshot of step 0 (the initial weights); lr 0.1 -> 0.05";
  EXPECT_TRUE(nanguard::is_runaway(e));
  EXPECT_EQ(nanguard::warning_line(e),
            "nanguard: step 2: loss diverging from the start: 8.7 is over 10 times the first loss (0.73): rolled "
            "back to the snapshot of step 0 (the initial weights); lr 0.1 -> 0.05; remedy: lower the LR or warm it "
            "up longer and clip the gradients (max_norm 1.0): the rollback cut the LR for this run only");
  EXPECT_FALSE(nanguard::is_runaway(bad(3, action::skip, "skipped the step")));
}

TEST(run_summary, the_summary_says_what_a_user_must_know) {
  run_narrator n;
  n.observe(taken(1, 9.7));
  n.observe(taken(2, 9.9));
  step_event rb = bad(3, action::rollback, "rolled back to the snapshot of step 0; lr 0.1 -> 0.05");
  rb.rollback_to = 0;
  n.observe(rb);
  const nanguard::run_summary& s = n.summary();
  EXPECT_EQ(s.not_taken, 1);
  EXPECT_EQ(s.rolled_back, 1);
  EXPECT_EQ(s.last_cause, "non-finite gradient");
  EXPECT_EQ(s.ended_on_snapshot, std::optional<int64_t>(0));
  EXPECT_EQ(n.summary_line(),
            "nanguard: 3 steps, 1 not taken (0 skipped, 1 rolled back); last bad step 3 [non-finite gradient]; "
            "loss 9.7 (step 1) -> 9.9 (step 2), not below the first; ended on its initial weights (rolled back to "
            "before step 1)");
  n.observe(taken(4, 0.5));
  EXPECT_FALSE(n.summary().ended_on_snapshot.has_value());
  step_event stop = bad(5, action::abort, "stopped training");
  stop.scale = 32768;
  n.observe(stop);
  EXPECT_EQ(n.summary_line(),
            "nanguard: 5 steps, 2 not taken (1 skipped, 1 rolled back); last bad step 5 [non-finite gradient]; "
            "loss 9.7 (step 1) -> 0.5 (step 4); loss scale 32768; the last rollback restored the initial weights "
            "(before step 1); stopped at step 5 (abort)");
  run_narrator clean;
  clean.observe(taken(1, 1.0));
  clean.observe(taken(2, 0.5));
  EXPECT_EQ(clean.summary_line(), "nanguard: 2 steps, all taken; loss 1 (step 1) -> 0.5 (step 2)");
}

// -log(sigmoid(model(x)) * w): w = 0 takes the log of 0.
struct log_of_zero {
  torch::nn::Linear model{4, 1};
  torch::optim::SGD opt{model->parameters(), torch::optim::SGDOptions(0.01)};
  at::Tensor x = torch::randn({8, 4});
  nanguard::step_fn fn = [this](const std::vector<at::Tensor>& b) {
    return -(model->forward(b[0]).sigmoid() * b[1]).log().mean();
  };
  // Six steps, the 3rd to 5th with w = 0; returns what the guard printed.
  std::string run(nanguard::guard_options options) {
    testing::internal::CaptureStderr();
    {
      nanguard::guard g(model, opt, options);
      for (int i = 1; i <= 6; ++i) g.step({x, (i >= 3 && i <= 5 ? torch::zeros({8, 1}) : torch::ones({8, 1}))}, fn);
    }
    return testing::internal::GetCapturedStderr();
  }
};

TEST(run_summary, a_verbose_guard_warns_each_bad_step_and_sums_up_the_run_when_destroyed) {
  torch::manual_seed(0);
  log_of_zero t;
  const std::vector<std::string> lines = guard_lines(t.run(nanguard::guard_options()));
  ASSERT_EQ(lines.size(), 4u) << ::testing::PrintToString(lines);
  EXPECT_EQ(lines[0].rfind("nanguard: step 3: ", 0), 0u) << lines[0];
  for (const char* part : {"aten::log", "(forward)", "[log_of_nonpositive]", ": skipped the step", "; remedy: "})
    EXPECT_NE(lines[0].find(part), std::string::npos) << part << " in " << lines[0];
  EXPECT_NE(lines[1].find("step 4: "), std::string::npos) << lines[1];
  EXPECT_NE(lines[1].find("again (2nd time): skipped the step"), std::string::npos) << lines[1];
  EXPECT_EQ(lines[1].find("remedy"), std::string::npos) << lines[1];
  EXPECT_NE(lines[2].find("again (3rd time)"), std::string::npos) << lines[2];
  EXPECT_EQ(lines[3].rfind("nanguard: 6 steps, 3 not taken (3 skipped); last bad step 5 [log_of_nonpositive]; loss ", 0),
            0u)
      << lines[3];
}

TEST(run_summary, a_quiet_guard_prints_nothing_and_its_narrator_still_knows) {
  torch::manual_seed(0);
  log_of_zero t;
  EXPECT_TRUE(guard_lines(t.run(nanguard::guard_options().verbose(false))).empty());
  nanguard::guard g(t.model, t.opt, nanguard::guard_options().verbose(false));
  g.step({t.x, torch::zeros({8, 1})}, t.fn);
  EXPECT_NE(g.narrator().last_warning().find("[log_of_nonpositive]"), std::string::npos);
  EXPECT_EQ(g.narrator().summary().not_taken, 1);
}

TEST(run_summary, an_abort_warns_and_its_error_carries_the_cause_and_the_remedy) {
  torch::manual_seed(0);
  log_of_zero t;
  testing::internal::CaptureStderr();
  std::string message;
  {
    nanguard::guard g(t.model, t.opt, nanguard::guard_options().policy(nanguard::policy::abort).bundle_dir(""));
    try {
      g.step({t.x, torch::zeros({8, 1})}, t.fn);
    } catch (const nanguard::nonfinite_error& e) {
      message = e.what_without_backtrace();
    }
  }
  const std::vector<std::string> lines = guard_lines(testing::internal::GetCapturedStderr());
  EXPECT_NE(message.find("aten::log"), std::string::npos) << message;
  EXPECT_NE(message.find("; cause: log_of_nonpositive; remedy: "), std::string::npos) << message;
  ASSERT_EQ(lines.size(), 2u) << ::testing::PrintToString(lines);
  EXPECT_NE(lines[0].find(": stopped training"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find("stopped at step 1 (abort)"), std::string::npos) << lines[1];
}

}  // namespace
