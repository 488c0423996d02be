// Recovery under the default policy (auto), fault by fault: each guarded run
// must end finite, near the clean run for the faults of the data (a bad
// sample recurring every epoch, a batch whose log is of 0), far below its
// initial loss for a divergent LR, never on its initial weights, with a
// warning for each bad step and a summary. Then what stops a run that
// keeps going bad, the spike rollback, and the snapshots' cost budget.
#include "nanguard/guard.h"
#include "nanguard/training_host.h"

#include "support.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <map>
#include <cmath>
#include <thread>

namespace {

using nanguard::guard;
using nanguard::guard_options;
using nanguard::step_event;
using nanguard::test::error_of;

// Regression on 256 rows of 8 features, in 8 batches of 32 that come in the
// same order every epoch; `features` maps the rows before the model (the
// identity, or a log).
struct dataset {
  at::Tensor x, y;
  explicit dataset(double scale = 1.0) {
    torch::manual_seed(4);
    x = torch::randn({256, 8}) * scale;
    y = x.matmul(torch::randn({8, 1})) + 0.5 + 0.1 * torch::randn({256, 1});
  }
  std::vector<at::Tensor> batch(int64_t i) const {
    const int64_t b = i % 8;
    return {x.slice(0, 32 * b, 32 * (b + 1)), y.slice(0, 32 * b, 32 * (b + 1))};
  }
};

struct run {
  torch::nn::Linear model{nullptr};
  at::Tensor initial_weight;
  std::function<at::Tensor(const at::Tensor&)> features = [](const at::Tensor& x) { return x; };

  run() {
    torch::manual_seed(5);
    model = torch::nn::Linear(8, 1);
    initial_weight = model->weight.detach().clone();
  }
  nanguard::step_fn loss_fn() {
    return [this](const std::vector<at::Tensor>& b) {
      return (model->forward(features(b[0])) - b[1]).pow(2).mean();
    };
  }
  // The loss over `rows` (the clean ones) as the model stands.
  double loss_on(const at::Tensor& x, const at::Tensor& y) {
    const at::NoGradGuard no_grad;
    return loss_fn()({x, y}).item<double>();
  }
  bool at_initial_weights() const { return model->weight.detach().equal(initial_weight); }
};

// The steps of a guarded run and the warnings it gave.
struct guarded_result {
  int64_t bad_steps = 0, warnings = 0, forecasts = 0;
  std::vector<step_event> events;
};

guarded_result train(guard& g, const std::function<std::vector<at::Tensor>(int64_t)>& batch_of, run& r,
                     int64_t steps) {
  guarded_result out;
  for (int64_t i = 0; i < steps; ++i) {
    out.events.push_back(g.step(batch_of(i), r.loss_fn()));
    const step_event& e = out.events.back();
    out.forecasts += e.forecast.has_value();
    if (e.skipped) {
      ++out.bad_steps;
      out.warnings += !g.narrator().last_warning().empty();
    }
  }
  return out;
}

// The same run on clean data with a plain loop: the loss a recovery is held to.
double clean_final_loss(const dataset& clean, int64_t steps, const std::function<void(run&)>& setup = {}) {
  run r;
  if (setup) setup(r);
  torch::optim::Adam opt(r.model->parameters(), torch::optim::AdamOptions(0.05));
  for (int64_t i = 0; i < steps; ++i) {
    opt.zero_grad();
    r.loss_fn()(clean.batch(i)).backward();
    opt.step();
  }
  return r.loss_on(clean.x, clean.y);
}

// `clean` with a NaN in row 37: in batch 1, every epoch.
dataset with_a_nan_in_row_37(const dataset& clean) {
  dataset faulty = clean;
  faulty.x = clean.x.clone();
  faulty.x[37][3] = std::numeric_limits<float>::quiet_NaN();
  return faulty;
}

// Every row but row 37.
at::Tensor without_row_37(const at::Tensor& t) { return at::cat({t.slice(0, 0, 37), t.slice(0, 38)}); }

TEST(recovery, a_bad_sample_recurring_every_epoch_is_quarantined_and_the_run_ends_near_the_clean_one) {
  const dataset clean;
  const dataset faulty = with_a_nan_in_row_37(clean);
  run r;
  torch::optim::Adam opt(r.model->parameters(), torch::optim::AdamOptions(0.05));
  guard g(r.model, opt, guard_options().verbose(false));
  const guarded_result res = train(g, [&](int64_t i) { return faulty.batch(i); }, r, 200);

  EXPECT_EQ(25, res.bad_steps);  // one per epoch
  EXPECT_EQ(res.bad_steps, res.warnings);
  EXPECT_EQ(0, res.forecasts) << "a healthy run's loss does not leave the range";
  EXPECT_EQ(0, g.rollbacks());
  ASSERT_EQ(nanguard::action::skip, res.events[1].action);
  EXPECT_NE(std::string::npos, res.events[1].note.find("batch quarantined")) << res.events[1].note;
  const step_event& again = res.events[9];
  EXPECT_EQ(nanguard::action::skip, again.action);
  EXPECT_NE(std::string::npos, again.note.find("quarantined batch (bad at step 2 first, 2 times now)")) << again.note;
  ASSERT_FALSE(again.findings.empty());  // the finding that quarantined it
  EXPECT_EQ(nanguard::cause::bad_data, again.findings.front().diagnosis.cause);
  EXPECT_EQ(nanguard::verdict::none, again.verdict);  // not replayed

  const double final_loss = r.loss_on(without_row_37(clean.x), without_row_37(clean.y));
  EXPECT_TRUE(std::isfinite(final_loss));
  EXPECT_LT(final_loss, 1.25 * clean_final_loss(clean, 200)) << final_loss;
  EXPECT_FALSE(r.at_initial_weights());
  EXPECT_NE(std::string::npos, g.narrator().summary_line().find("25 not taken (25 skipped)"))
      << g.narrator().summary_line();
}

TEST(recovery, a_divergent_lr_is_rolled_back_and_cut_until_the_run_converges) {
  const dataset data(3.0);  // stable for SGD below an LR of about 0.08
  run r;
  const double initial_loss = r.loss_on(data.x, data.y);
  torch::optim::SGD opt(r.model->parameters(), torch::optim::SGDOptions(3.0));
  guard g(r.model, opt, guard_options().verbose(false));
  const guarded_result res = train(g, [&](int64_t) { return std::vector<at::Tensor>{data.x, data.y}; }, r, 300);

  EXPECT_GE(g.rollbacks(), 3);  // 3.0 cut by 0.5, 0.25, 0.125: below 0.08
  EXPECT_LT(nanguard::get_lr(opt), 0.08);
  EXPECT_EQ(res.bad_steps, res.warnings);
  const double final_loss = r.loss_on(data.x, data.y);
  EXPECT_TRUE(std::isfinite(final_loss));
  EXPECT_LT(final_loss, 0.5 * initial_loss) << final_loss << " from " << initial_loss;
  EXPECT_FALSE(r.at_initial_weights());
  EXPECT_FALSE(res.events.back().skipped);
  EXPECT_NE(std::string::npos, g.narrator().summary_line().find("rolled back")) << g.narrator().summary_line();
}

// A regression MLP (8 -> 32 -> 1) on inputs of scale 30 that diverges from
// its first step at `lr`: the guard at its defaults must bring it below
// half its initial loss within the steps a clean run at a stable LR takes,
// end on finite weights it trained (status "recovered"), and say the LR.
struct diverging_mlp {
  const dataset data{30.0};
  torch::nn::Sequential model;
  explicit diverging_mlp() {
    torch::manual_seed(6);
    model = torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::ReLU(), torch::nn::Linear(32, 1));
  }
  nanguard::step_fn loss_fn() {
    return [this](const std::vector<at::Tensor>& b) { return (model->forward(b[0]) - b[1]).pow(2).mean(); };
  }
  double loss() {
    const at::NoGradGuard no_grad;
    return loss_fn()({data.x, data.y}).item<double>();
  }
  // Trains `steps` steps under a guard at its defaults.
  nanguard::run_summary guarded(torch::optim::Optimizer& opt, int64_t steps) {
    guard g(*model, opt, guard_options().verbose(false));
    for (int64_t i = 0; i < steps; ++i) g.step(data.batch(i), loss_fn());
    return g.narrator().summary();
  }
};

void expect_rescued(diverging_mlp& m, double initial_loss, const nanguard::run_summary& s) {
  const double final_loss = m.loss();
  EXPECT_TRUE(std::isfinite(final_loss));
  EXPECT_LT(final_loss, 0.5 * initial_loss) << final_loss << " from " << initial_loss;
  EXPECT_STREQ("recovered", nanguard::run_status(s)) << nanguard::to_string(s);
  EXPECT_GE(s.rolled_back, 1);
  EXPECT_NE(std::string::npos, nanguard::to_string(s).find("(cut by rollbacks): start the next run at lr <= "))
      << nanguard::to_string(s);
}

TEST(recovery, sgd_diverging_from_its_first_step_is_rescued_within_the_clean_runs_steps) {
  diverging_mlp m;
  const double initial_loss = m.loss();
  torch::optim::SGD opt(m.model->parameters(), torch::optim::SGDOptions(3.0));  // stable at about 0.03
  const nanguard::run_summary s = m.guarded(opt, 300);
  expect_rescued(m, initial_loss, s);
  EXPECT_LE(s.rolled_back, 6) << "the cut escalates: 0.5, 0.25, 0.125, ...";
}

TEST(recovery, adamw_diverging_from_its_first_step_is_rescued_within_the_clean_runs_steps) {
  diverging_mlp m;
  const double initial_loss = m.loss();
  torch::optim::AdamW opt(m.model->parameters(), torch::optim::AdamWOptions(3.0));  // 100x a stable 0.03
  const nanguard::run_summary s = m.guarded(opt, 300);
  expect_rescued(m, initial_loss, s);
}

TEST(recovery, a_snapshot_of_a_run_already_diverging_is_no_rollback_target) {
  diverging_mlp m;
  const double initial_loss = m.loss();
  torch::optim::SGD opt(m.model->parameters(), torch::optim::SGDOptions(3.0));
  guard g(*m.model, opt, guard_options().verbose(false).policy(nanguard::policy::rollback).snapshot_every(1));
  std::map<int64_t, double> loss_of_step;
  int64_t rollbacks = 0;
  for (int64_t i = 0; i < 100; ++i) {
    const step_event e = g.step(m.data.batch(i), m.loss_fn());
    loss_of_step[e.step] = e.loss;
    if (e.action != nanguard::action::rollback) continue;
    ++rollbacks;
    if (e.rollback_to > 0) EXPECT_LT(loss_of_step[e.rollback_to], 10 * initial_loss) << "step " << e.rollback_to;
  }
  EXPECT_GE(rollbacks, 1);
  EXPECT_LT(m.loss(), 0.5 * initial_loss);
}

TEST(recovery, a_bad_sample_under_policy_rollback_keeps_the_lr_and_is_quarantined) {
  const dataset clean;
  const dataset faulty = with_a_nan_in_row_37(clean);
  run r;
  torch::optim::Adam opt(r.model->parameters(), torch::optim::AdamOptions(0.05));
  guard g(r.model, opt, guard_options().verbose(false).policy(nanguard::policy::rollback));
  const guarded_result res = train(g, [&](int64_t i) { return faulty.batch(i); }, r, 200);

  EXPECT_EQ(25, res.bad_steps);
  EXPECT_EQ(1, g.rollbacks());  // the first time; then the quarantined batch is skipped
  EXPECT_DOUBLE_EQ(0.05, nanguard::get_lr(opt));
  EXPECT_EQ(nanguard::action::skip, res.events[9].action);
  const double final_loss = r.loss_on(without_row_37(clean.x), without_row_37(clean.y));
  EXPECT_LT(final_loss, 1.25 * clean_final_loss(clean, 200)) << final_loss;
}

TEST(recovery, a_batch_whose_log_is_of_zero_is_skipped_without_touching_the_lr) {
  dataset clean;
  clean.x = clean.x.exp();  // positive features, read through a log
  dataset faulty = clean;
  faulty.x = clean.x.clone();
  faulty.x[37][3] = 0.0;
  const auto log_features = [](run& r) { r.features = [](const at::Tensor& x) { return x.log(); }; };
  run r;
  log_features(r);
  torch::optim::Adam opt(r.model->parameters(), torch::optim::AdamOptions(0.05));
  guard g(r.model, opt, guard_options().verbose(false));
  const guarded_result res = train(g, [&](int64_t i) { return faulty.batch(i); }, r, 200);

  EXPECT_EQ(25, res.bad_steps);
  EXPECT_EQ(res.bad_steps, res.warnings);
  EXPECT_EQ(0, g.rollbacks());
  EXPECT_DOUBLE_EQ(0.05, nanguard::get_lr(opt));
  ASSERT_FALSE(res.events[1].findings.empty());
  EXPECT_EQ("aten::log", res.events[1].findings.front().op);
  EXPECT_NE(std::string::npos, res.events[9].note.find("batch quarantined (bad at step 2 and 10)"))
      << res.events[9].note;
  EXPECT_NE(std::string::npos, res.events[17].note.find("quarantined batch (bad at step 2 first, 3 times now)"))
      << res.events[17].note;
  const double final_loss = r.loss_on(without_row_37(clean.x), without_row_37(clean.y));
  EXPECT_LT(final_loss, 1.25 * clean_final_loss(clean, 200, log_features)) << final_loss;
  EXPECT_FALSE(r.at_initial_weights());
}

// float16 emulated on the CPU: the activation and its gradient round-trip
// through Half, whose range the loss scale's gradients overflow.
TEST(recovery, a_float16_overflow_of_the_scaled_gradients_backs_the_loss_scale_off) {
  torch::manual_seed(2);
  torch::nn::Linear l1(16, 16), l2(16, 1);
  torch::nn::Sequential model(l1, l2);
  const at::Tensor w0 = l1->weight.detach().clone();
  const at::Tensor x = torch::randn({32, 16}), y = torch::randn({32, 1}) * 1000;
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  guard g(*model, opt, guard_options().verbose(false).scaler(nanguard::loss_scaler_options().init_scale(65536)));
  const auto fn = [&](const std::vector<at::Tensor>& b) {
    const at::Tensor h = l1->forward(b[0]).to(at::kHalf).to(at::kFloat);
    return (l2->forward(h) - b[1]).pow(2).mean();
  };
  std::vector<step_event> events;
  for (int i = 0; i < 60; ++i) events.push_back(g.step({x, y}, fn));
  EXPECT_EQ(nanguard::action::backoff, events[0].action);
  EXPECT_EQ(0, g.rollbacks());
  EXPECT_LT(g.skipped(), 20);
  const auto taken = [](const step_event& e) { return !e.skipped; };
  const auto first_taken = std::find_if(events.begin(), events.end(), taken);
  const auto last_taken = std::find_if(events.rbegin(), events.rend(), taken);
  ASSERT_NE(events.end(), first_taken);
  EXPECT_GE(std::count_if(events.end() - 20, events.end(), taken), 18);  // the scale found its level
  EXPECT_TRUE(std::isfinite(last_taken->loss));
  EXPECT_LT(last_taken->loss, first_taken->loss);
  for (const step_event& e : events) EXPECT_NE(nanguard::action::rollback, e.action) << e.step;
  EXPECT_FALSE(l1->weight.detach().equal(w0));
}

TEST(recovery, a_run_that_keeps_going_bad_stops_with_a_bundle_after_max_bad_steps) {
  run r;
  torch::optim::SGD opt(r.model->parameters(), torch::optim::SGDOptions(0.1));
  const std::string bundles = ::testing::TempDir() + "nanguard_recovery_bundles";
  guard g(r.model, opt, guard_options().verbose(false).bundle_dir(bundles));
  const at::Tensor x = torch::full({4, 8}, std::numeric_limits<float>::quiet_NaN()), y = torch::zeros({4, 1});
  int64_t steps = 0;
  EXPECT_THROW(
      {
        for (; steps < 100; ++steps) g.step({x, y}, r.loss_fn());
      },
      nanguard::nonfinite_error);
  EXPECT_EQ(19, steps);  // the 20th throws
  EXPECT_EQ(nanguard::action::abort, g.last_event().action);
  EXPECT_NE(std::string::npos, g.last_event().note.find("max_bad_steps=20: 20 bad steps in a row"))
      << g.last_event().note;
  EXPECT_FALSE(g.last_event().bundle.empty());
}

TEST(recovery, a_run_mostly_bad_stops_at_max_bad_fraction) {
  run r;
  torch::optim::SGD opt(r.model->parameters(), torch::optim::SGDOptions(0.01));
  guard g(r.model, opt, guard_options().verbose(false).bundle_dir(""));
  const dataset data;
  int64_t steps = 0;
  EXPECT_THROW(
      {
        for (; steps < 100; ++steps) {
          std::vector<at::Tensor> b = data.batch(steps);
          if (steps % 3 != 0) b[0] = b[0] * std::numeric_limits<float>::quiet_NaN();
          g.step(b, r.loss_fn());
        }
      },
      nanguard::nonfinite_error);
  EXPECT_NE(std::string::npos, g.last_event().note.find("max_bad_fraction=0.5")) << g.last_event().note;
  EXPECT_LT(steps, 30);
  EXPECT_EQ(
      "nanguard::guard_options: max_bad_fraction must be in (0, 1] but is 0; 1 never aborts on its own, 0.5 aborts "
      "when most recent steps are bad",
      error_of([&] { guard(r.model, opt, guard_options().max_bad_fraction(0)); }));
}

TEST(recovery, a_loss_that_runs_away_rolls_back_before_the_nan) {
  const dataset data;
  run r;
  torch::optim::SGD opt(r.model->parameters(), torch::optim::SGDOptions(0.05));
  guard g(r.model, opt, guard_options().verbose(false));
  std::optional<step_event> first_rollback;
  for (int64_t i = 0; i < 80 && !first_rollback; ++i) {
    if (i == 40) nanguard::set_lr(opt, 1.2);  // about 3x the loss each step: finite for a while
    const step_event e = g.step({data.x, data.y}, r.loss_fn());
    if (e.action == nanguard::action::rollback) first_rollback = e;
  }
  ASSERT_TRUE(first_rollback);
  EXPECT_TRUE(std::isfinite(first_rollback->loss)) << first_rollback->loss;
  // Three spikes in a row, or (first here) a loss 1000x the run's best: both before the NaN.
  EXPECT_NE(std::string::npos, first_rollback->reason.find("diverging: ")) << first_rollback->reason;
  EXPECT_GE(first_rollback->rollback_to, 30);
  EXPECT_TRUE(first_rollback->findings.empty());
}

// A host whose snapshots take 20 ms: against steps of well under 1 ms, the
// guard takes them 10 times less often than every snapshot_every steps
// (the fast one's, some microseconds, keep to it).
struct slow_snapshot_host : nanguard::module_host {
  using module_host::module_host;
  std::shared_ptr<const nanguard::saved_state> save() override {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return module_host::save();
  }
};

TEST(recovery, snapshots_are_taken_less_often_when_they_cost_more_than_their_budget) {
  const dataset data;
  run fast, slow;
  torch::optim::SGD fast_opt(fast.model->parameters(), torch::optim::SGDOptions(0.01));
  torch::optim::SGD slow_opt(slow.model->parameters(), torch::optim::SGDOptions(0.01));
  guard fast_guard(fast.model, fast_opt, guard_options().verbose(false));
  guard slow_guard(std::make_shared<slow_snapshot_host>(*slow.model, slow_opt), guard_options().verbose(false));
  for (int64_t i = 0; i < 120; ++i) {
    fast_guard.step(data.batch(i), fast.loss_fn());
    slow_guard.step(data.batch(i), slow.loss_fn());
  }
  // Every 10 steps, from step 11: the first waits for a spike window of 10 steps to call a step calm.
  EXPECT_EQ((std::vector<int64_t>{0, 101, 111}), fast_guard.snapshots().steps());
  EXPECT_EQ((std::vector<int64_t>{0, 100}), slow_guard.snapshots().steps());
}

}  // namespace
