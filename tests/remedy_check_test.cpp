// Verified remedies through the guard: every cause with a mechanical remedy
// gets "verified finite" from it on the failing step (the step replayed
// with the remedy applied), a step with a second bug the remedy does not
// reach gets "still non-finite", a cause with none gets "not checkable";
// the model, optimizer and RNG are as they were; auto_fix keeps the
// verified rewrite and the run goes on finite. The rewrites on their own:
// op_patch_test.cpp.
#include <nanguard/guard.h>
#include <nanguard/remedy_check.h>

#include "support.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <optional>

namespace {

using nanguard::cause;
using nanguard::check_result;
using nanguard::guard;
using nanguard::guard_options;
using nanguard::policy;
using nanguard::remedy_check;
using nanguard::remedy_kind;
using nanguard::step_event;

constexpr double kInf = std::numeric_limits<double>::infinity();

struct linear_run {
  torch::nn::Linear model;
  torch::optim::SGD optimizer;
  explicit linear_run(int64_t in, int64_t out = 1, double lr = 0.01)
      : model(in, out), optimizer(model->parameters(), torch::optim::SGDOptions(lr)) {
    torch::manual_seed(0);
  }
};

// A model on standardized inputs, (x - mean) / std: a constant column is 0 / 0.
at::Tensor standardized_loss(torch::nn::Linear& model, const std::vector<at::Tensor>& b) {
  const at::Tensor x = b[0];
  return (model->forward((x - x.mean(0)) / x.std(0)) - 1).pow(2).mean();
}

// The bad step's first finding's checks (the test fails when there is none).
std::vector<remedy_check> checks_of(const step_event& e) {
  EXPECT_FALSE(e.findings.empty()) << "no finding; note: " << e.note;
  return e.findings.empty() ? std::vector<remedy_check>{} : e.findings.front().remedy_checks;
}

// A skipped step whose finding has `cause` (when given) and whose first
// finite check is a remedy of `kind` that applied `applied_part`.
void expect_verified(const step_event& e, std::optional<nanguard::cause> cause, remedy_kind kind,
                     const std::string& applied_part) {
  EXPECT_TRUE(e.skipped);
  if (cause && !e.findings.empty())
    EXPECT_EQ(e.findings.front().diagnosis.cause, *cause) << to_text(e.findings.front());
  const std::vector<remedy_check> checks = checks_of(e);
  const remedy_check* v = nanguard::verified_remedy(checks);
  ASSERT_NE(v, nullptr) << (checks.empty() ? "no check" : to_string(checks.front()));
  EXPECT_EQ(v->remedy, kind) << to_string(*v);
  EXPECT_NE(v->applied.find(applied_part), std::string::npos) << v->applied;
  EXPECT_TRUE(std::isfinite(v->loss)) << to_string(*v);
}

guard_options skip() { return guard_options().policy(policy::skip).verbose(false); }

TEST(remedy_check, an_eps_in_a_zero_denominator_is_verified) {
  linear_run run(3, 3);
  guard g(*run.model, run.optimizer, skip());
  const at::Tensor x = torch::randn({8, 3}).index_fill_(1, torch::tensor({1}), 2.0);  // column 1: std 0
  const step_event e =
      g.step({x}, [&](const std::vector<at::Tensor>& b) { return standardized_loss(run.model, b); });
  expect_verified(e, cause::division_by_zero,
                  remedy_kind::denominator_eps, "eps 1e-05 on the zero denominators of aten::div");
}

TEST(remedy_check, a_clamp_before_log_is_verified) {
  linear_run run(3);
  guard g(*run.model, run.optimizer, skip());
  {
    const at::NoGradGuard no_grad;
    run.model->bias.fill_(-100.0);  // relu gives 0 everywhere: log(0) = -inf
  }
  const step_event e = g.step({torch::randn({8, 3})}, [&](const std::vector<at::Tensor>& b) {
    return -run.model->forward(b[0]).relu().log().mean();
  });
  expect_verified(e, cause::log_of_nonpositive,
                  remedy_kind::clamp_input, "the input of aten::log clamped to >= 1e-12");
}

TEST(remedy_check, a_clamp_before_sqrt_is_verified_for_its_backward) {
  linear_run run(3, 2);
  guard g(*run.model, run.optimizer, skip());
  at::Tensor x = torch::randn({8, 3});
  x[0].zero_();
  {
    const at::NoGradGuard no_grad;
    run.model->bias.zero_();  // row 0 of the output is 0: the norm's sqrt at 0
  }
  const step_event e = g.step({x}, [&](const std::vector<at::Tensor>& b) {
    return run.model->forward(b[0]).pow(2).sum(1).sqrt().mean();
  });
  expect_verified(e, cause::sqrt_at_zero,
                  remedy_kind::clamp_input, "aten::sqrt");
}

TEST(remedy_check, a_clamp_into_the_domain_of_acos_is_verified) {
  linear_run run(3);
  guard g(*run.model, run.optimizer, skip());
  {
    const at::NoGradGuard no_grad;
    run.model->weight.zero_();
    run.model->bias.fill_(1.0);  // acos(1): its gradient is -inf
  }
  const step_event e = g.step({torch::randn({8, 3})}, [&](const std::vector<at::Tensor>& b) {
    return run.model->forward(b[0]).acos().mean();
  });
  expect_verified(e, cause::inverse_trig_at_bound,
                  remedy_kind::clamp_input, "aten::acos clamped to [-0.999999, 0.999999]");
}

TEST(remedy_check, a_safe_softmax_is_verified_for_a_fully_masked_row) {
  linear_run run(4, 4);
  guard g(*run.model, run.optimizer, skip());
  at::Tensor mask = torch::zeros({8, 4}, at::kBool);
  mask[2].fill_(true);  // row 2 sees nothing
  const step_event e = g.step({torch::randn({8, 4}), mask}, [&](const std::vector<at::Tensor>& b) {
    const at::Tensor scores = run.model->forward(b[0]).masked_fill(b[1], -kInf);
    return (scores.softmax(-1) * torch::arange(4)).sum(-1).mean();
  });
  expect_verified(e, cause::fully_masked_softmax,
                  remedy_kind::safe_softmax, "softmax");
}

TEST(remedy_check, float32_is_verified_for_a_float16_overflow) {
  linear_run run(3);
  run.model->to(at::kHalf);
  guard g(*run.model, run.optimizer, skip());
  {
    const at::NoGradGuard no_grad;
    run.model->weight.zero_();
    run.model->bias.fill_(300.0);  // 300^2 = 90000 > 65504
  }
  const step_event e = g.step({torch::randn({8, 3}).to(at::kHalf)}, [&](const std::vector<at::Tensor>& b) {
    return run.model->forward(b[0]).pow(2).mean();
  });
  expect_verified(e, std::nullopt, remedy_kind::float32, "aten::pow in float32 instead of Half");
}

TEST(remedy_check, a_lower_loss_scale_is_verified_for_a_float16_gradient_overflow) {
  linear_run run(3);
  run.model->to(at::kHalf);
  guard g(*run.model, run.optimizer,
          skip().scaler(nanguard::loss_scaler_options().init_scale(16777216.0).growth_interval(1000000)));
  const step_event e = g.step({torch::randn({8, 3}).to(at::kHalf) * 10}, [&](const std::vector<at::Tensor>& b) {
    return run.model->forward(b[0]).to(at::kFloat).pow(2).mean();
  });
  expect_verified(e, std::nullopt, remedy_kind::loss_scale_cut, "loss scale 1.67772e+07 -> ");
}

TEST(remedy_check, the_batch_without_its_nonfinite_rows_is_verified) {
  linear_run run(3);
  guard g(*run.model, run.optimizer, skip());
  at::Tensor x = torch::randn({8, 3});
  x[5][1] = std::numeric_limits<float>::quiet_NaN();
  const step_event e = g.step({x, torch::randn({8, 1})}, [&](const std::vector<at::Tensor>& b) {
    return torch::mse_loss(run.model->forward(b[0]), b[1]);
  });
  expect_verified(e, cause::bad_data,
                  remedy_kind::skip_rows, "the batch without its 1 non-finite row (of 8)");
}

TEST(remedy_check, a_second_bug_the_remedy_does_not_reach_stays_nonfinite) {
  linear_run run(3, 3);
  guard g(*run.model, run.optimizer, skip());
  const at::Tensor x = torch::randn({8, 3}).index_fill_(1, torch::tensor({1}), 2.0);
  const step_event e = g.step({x}, [&](const std::vector<at::Tensor>& b) {
    const at::Tensor z = run.model->forward(b[0]) / b[0].std(0);  // x / 0 first
    return z.pow(2).mean() + (z - z).log().mean();                 // then log(0)
  });
  const std::vector<remedy_check> checks = checks_of(e);
  ASSERT_EQ(checks.size(), 1u);
  EXPECT_EQ(checks[0].result, check_result::still_nonfinite) << to_string(checks[0]);
  EXPECT_NE(checks[0].detail.find("aten::log"), std::string::npos) << checks[0].detail;
  EXPECT_EQ(nanguard::verified_remedy(checks), nullptr);
}

TEST(remedy_check, a_remedy_whose_loss_runs_away_from_the_run_s_has_not_saved_the_step) {
  linear_run run(3, 3);
  guard g(*run.model, run.optimizer, skip());
  const auto fn = [&](const std::vector<at::Tensor>& b) {
    return (run.model->forward(b[0]) / b[0].std(0)).pow(2).mean();  // x / (0 + 1e-5): finite, 1e10 times too big
  };
  ASSERT_FALSE(g.step({torch::randn({8, 3})}, fn).skipped);
  const step_event e = g.step({torch::randn({8, 3}).index_fill_(1, torch::tensor({1}), 2.0)}, fn);
  const std::vector<remedy_check> checks = checks_of(e);
  ASSERT_EQ(checks.size(), 1u);
  EXPECT_EQ(checks[0].result, check_result::still_nonfinite) << to_string(checks[0]);
  EXPECT_NE(checks[0].detail.find("runs away from the run's recent"), std::string::npos) << checks[0].detail;
}

TEST(remedy_check, a_remedy_check_leaves_the_model_and_the_rng_as_they_were) {
  linear_run run(3, 3);
  guard g(*run.model, run.optimizer, skip());
  const at::Tensor x = torch::randn({8, 3}).index_fill_(1, torch::tensor({1}), 2.0);
  const at::Tensor weight = run.model->weight.detach().clone();
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  const at::Tensor rng = gen.get_state();
  const step_event e = g.step({x}, [&](const std::vector<at::Tensor>& b) {
    return (torch::dropout(run.model->forward(b[0]), 0.5, true) / b[0].std(0)).pow(2).mean();
  });
  const at::Tensor rng_after = gen.get_state();
  ASSERT_NE(nanguard::verified_remedy(checks_of(e)), nullptr);
  EXPECT_TRUE(torch::equal(run.model->weight, weight));
  for (const at::Tensor& p : run.model->parameters()) EXPECT_FALSE(p.grad().defined() && p.grad().abs().sum().item<double>() > 0);
  // The step's own forward drew from the generator once; the checks' replays left it there.
  gen.set_state(rng);
  (void)torch::dropout(torch::ones({8, 3}), 0.5, true);
  EXPECT_TRUE(torch::equal(gen.get_state(), rng_after));
}

TEST(remedy_check, a_cause_without_a_mechanical_remedy_is_not_checkable) {
  linear_run run(3);
  guard g(*run.model, run.optimizer, skip());
  const step_event e = g.step({torch::randn({8, 3})}, [&](const std::vector<at::Tensor>& b) {
    const at::Tensor inf = run.model->forward(b[0]) * kInf;  // an inf that came first...
    return (inf - inf).mean();                                // ...inf - inf
  });
  const std::vector<remedy_check> checks = checks_of(e);
  ASSERT_FALSE(checks.empty());
  EXPECT_EQ(checks.back().result, check_result::not_checkable) << to_string(checks.back());
}

TEST(remedy_check, verify_remedies_false_checks_nothing) {
  linear_run run(3, 3);
  guard g(*run.model, run.optimizer, skip().verify_remedies(false));
  const at::Tensor x = torch::randn({8, 3}).index_fill_(1, torch::tensor({1}), 2.0);
  const step_event e = g.step({x}, [&](const std::vector<at::Tensor>& b) {
    return (run.model->forward(b[0]) / b[0].std(0)).pow(2).mean();
  });
  ASSERT_FALSE(e.findings.empty());
  EXPECT_TRUE(e.findings.front().remedy_checks.empty());
}

TEST(remedy_check, an_lr_cut_from_the_last_calm_snapshot_is_verified_for_a_divergence) {
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(4, 16), torch::nn::ReLU(), torch::nn::Linear(16, 1));
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05));
  guard g(*model, optimizer,
          guard_options().policy(policy::rollback).spike_rollback_z(0).verbose(false));
  const at::Tensor x = torch::randn({32, 4}) * 30, y = torch::randn({32, 1});
  const auto fn = [&](const std::vector<at::Tensor>& b) { return torch::mse_loss(model->forward(b[0]), b[1]); };
  const step_event* bad = nullptr;
  std::vector<step_event> events;
  for (int step = 0; step < 60 && !bad; ++step) {
    events.push_back(g.step({x, y}, fn));
    if (!events.back().findings.empty()) bad = &events.back();
  }
  ASSERT_NE(bad, nullptr) << "the run never went non-finite";
  const std::vector<remedy_check> checks = checks_of(*bad);
  ASSERT_FALSE(checks.empty());
  EXPECT_EQ(checks.front().remedy, remedy_kind::lr_cut) << to_text(bad->findings.front());
  EXPECT_EQ(checks.front().result, check_result::finite) << to_string(checks.front());
}

TEST(remedy_check, auto_fix_keeps_the_verified_rewrite_and_the_run_goes_on) {
  linear_run run(3, 3);
  guard g(*run.model, run.optimizer, skip().auto_fix(true));
  const auto fn = [&](const std::vector<at::Tensor>& b) { return standardized_loss(run.model, b); };
  const at::Tensor x = torch::randn({8, 3}).index_fill_(1, torch::tensor({1}), 2.0);
  const step_event first = g.step({x}, fn);
  ASSERT_TRUE(first.skipped);
  EXPECT_EQ(first.auto_fix, "eps 1e-05 on the zero denominators of aten::div");
  for (int i = 0; i < 3; ++i) {
    const step_event e = g.step({x}, fn);
    EXPECT_FALSE(e.skipped) << e.reason << "; " << e.note << "; " << (e.findings.empty() ? "" : to_text(e.findings.front()));
    EXPECT_EQ(e.auto_fix, first.auto_fix);
  }
  EXPECT_NE(g.narrator().summary_line().find("auto_fix kept eps 1e-05 on the zero denominators of aten::div from step 1"),
            std::string::npos)
      << g.narrator().summary_line();
}

TEST(remedy_check, auto_fix_needs_verify_remedies) {
  linear_run run(3);
  EXPECT_NE(nanguard::test::error_of([&] { guard g(*run.model, run.optimizer, skip().verify_remedies(false).auto_fix(true)); })
                .find("auto_fix keeps a verified remedy, but verify_remedies is false"),
            std::string::npos);
}

TEST(remedy_check, its_line_says_the_result_what_was_applied_and_the_loss) {
  remedy_check c;
  c.remedy = remedy_kind::denominator_eps;
  c.applied = "eps 1e-05 on the zero denominators of aten::div";
  c.result = check_result::finite;
  c.loss = 0.52;
  EXPECT_EQ(to_string(c), "verified finite: eps 1e-05 on the zero denominators of aten::div (replayed loss 0.52)");
  EXPECT_EQ(nanguard::remedy_kind_from_string("skip_rows"), remedy_kind::skip_rows);
  EXPECT_NE(nanguard::test::error_of([] { nanguard::check_result_from_string("fine"); })
                .find("check_result must be one of 'finite', 'still_nonfinite', 'not_checkable' but is 'fine'"),
            std::string::npos);
}

}  // namespace
