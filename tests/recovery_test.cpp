// recovery on its own: docs/guard.md's decision table row by row against
// recovery::decide, on step records made by hand (no training: the host is
// a one-layer model that never steps), then the rows' bookkeeping
// (quarantine, bad steps in a row, the runaway loss) and the rollback.
// The same rules end to end, a model trained per row: recovery_acceptance_test.cpp.
#include "guard/recovery.h"

#include "nanguard/training_host.h"

#include "support.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>

namespace {

using nanguard::cause;
using nanguard::guard_options;
using nanguard::policy;
using nanguard::detail::recovery;
using nanguard::detail::step_record;

// A host whose model and optimizer exist but never train: recovery reads
// and restores its state, decide() never touches it.
struct fixture {
  torch::nn::Linear model{2, 1};
  torch::optim::SGD optimizer{model->parameters(), torch::optim::SGDOptions(0.1)};
  nanguard::module_host host{*model, optimizer};
  guard_options options;
  nanguard::loss_scaler scaler;
  std::unique_ptr<recovery> r;

  explicit fixture(guard_options o = {}) : options(std::move(o)), scaler(options.scaler()) {
    r = std::make_unique<recovery>(host, scaler, options, nullptr);
    r->snapshot(0);  // as the guard does: the initial weights
  }
};

// The one micro-batch of value `x` (distinct values: distinct batches),
// alive for the whole test: a record refers to its batches.
const nanguard::micro_batches& batch_of(float x) {
  static std::map<float, nanguard::micro_batches> batches;
  auto [it, added] = batches.try_emplace(x);
  if (added) it->second = {{torch::full({2}, x)}};
  return it->second;
}

// A bad step of batch `x` whose first finding has cause `c` (none: no
// finding), loss `loss`.
step_record bad_step(std::optional<cause> c, double loss = nanguard::test::kNaN, float x = 1.0f) {
  step_record rec;
  rec.batches = &batch_of(x);
  rec.event.step = 7;
  rec.event.loss = loss;
  if (c) {
    nanguard::finding f;
    f.diagnosis.cause = *c;
    rec.event.findings.push_back(f);
  }
  return rec;
}

guard_options with_scaler() { return guard_options().scaler(nanguard::loss_scaler_options().enabled(true)); }

// ---- the decision table, row by row (docs/guard.md, "policy auto")

TEST(recovery, a_quarantined_batch_is_skipped) {
  fixture f;
  step_record rec = bad_step(cause::overflow);
  rec.quarantined = true;
  EXPECT_EQ(f.r->decide(rec).policy, policy::skip);
}

TEST(recovery, bad_data_is_skipped) {
  fixture f;
  EXPECT_EQ(f.r->decide(bad_step(cause::bad_data)).policy, policy::skip);
}

TEST(recovery, a_finite_loss_whose_scaled_gradients_overflowed_backs_off) {
  fixture f(with_scaler());
  for (std::optional<cause> c : {std::optional<cause>(), std::optional(cause::precision_range),
                                 std::optional(cause::overflow)})
    EXPECT_EQ(f.r->decide(bad_step(c, /*loss=*/2.5)).policy, policy::backoff) << (c ? to_string(*c) : "no cause");
}

TEST(recovery, a_divergence_or_an_overflow_rolls_back) {
  fixture f;
  EXPECT_EQ(f.r->decide(bad_step(cause::divergence)).policy, policy::rollback);
  EXPECT_EQ(f.r->decide(bad_step(cause::overflow)).policy, policy::rollback);
  // With the scaler on but a non-finite loss, an overflow is the model's, not the scale's.
  fixture scaled(with_scaler());
  EXPECT_EQ(scaled.r->decide(bad_step(cause::overflow)).policy, policy::rollback);
}

TEST(recovery, precision_range_backs_off_with_the_scaler_on_else_skips) {
  fixture scaled(with_scaler());
  EXPECT_EQ(scaled.r->decide(bad_step(cause::precision_range)).policy, policy::backoff);
  fixture plain;
  EXPECT_EQ(plain.r->decide(bad_step(cause::precision_range)).policy, policy::skip);
}

TEST(recovery, any_other_cause_or_none_is_skipped) {
  fixture f;
  for (cause c : nanguard::all_causes) {
    if (c == cause::divergence || c == cause::overflow) continue;
    EXPECT_EQ(f.r->decide(bad_step(c)).policy, policy::skip) << to_string(c);
  }
  EXPECT_EQ(f.r->decide(bad_step(std::nullopt)).policy, policy::skip);
}

TEST(recovery, the_third_bad_step_in_a_row_rolls_back) {
  fixture f;
  const step_record rec = bad_step(cause::log_of_nonpositive);
  f.r->count_not_taken();
  f.r->count_not_taken();
  EXPECT_EQ(f.r->decide(rec).policy, policy::skip);
  f.r->count_not_taken();
  EXPECT_EQ(f.r->decide(rec).policy, policy::rollback);
  f.r->count_taken();  // a good step in between starts the count again
  f.r->count_not_taken();
  EXPECT_EQ(f.r->decide(rec).policy, policy::skip);
}

// `n` finite steps of loss `loss` and grad norm 1.
void observe_calm(recovery& r, int n, double loss = 1.0) {
  for (int i = 0; i < n; ++i) {
    nanguard::step_event calm;
    calm.loss = loss;
    calm.grad_norm = 1.0;
    r.observe_finite(calm);
  }
}

TEST(recovery, a_loss_that_spikes_three_times_in_a_row_rolls_back_before_the_nan) {
  fixture f;
  observe_calm(*f.r, 10);
  step_record rec;
  rec.locally_finite = true;
  for (int i = 0; i < 3; ++i) {
    EXPECT_FALSE(f.r->running_away()) << "after " << i << " spikes";
    rec.event.loss = 100;  // 10x the median, under 1000x the best
    rec.event.spikes = {{"loss", 100, 1e4}};
    f.r->observe_finite(rec.event);
  }
  ASSERT_TRUE(f.r->running_away());
  EXPECT_NE(rec.event.reason.find("loss diverging: a spike of z >= 100 on 3 steps in a row"), std::string::npos)
      << rec.event.reason;
  rec.runaway = true;
  EXPECT_EQ(f.r->decide(rec).policy, policy::rollback);
}

TEST(recovery, a_loss_1000_times_the_runs_best_rolls_back_at_once_under_auto_and_rollback) {
  for (policy p : {policy::automatic, policy::rollback}) {
    fixture f(guard_options().policy(p));
    observe_calm(*f.r, 3, 9.4);
    observe_calm(*f.r, 5, 2.0);  // the best window: a median of 2
    nanguard::step_event e;
    e.loss = 1999;
    f.r->observe_finite(e);
    EXPECT_FALSE(f.r->running_away()) << to_string(p);
    e.loss = 2001;
    f.r->observe_finite(e);
    EXPECT_TRUE(f.r->running_away()) << to_string(p);
    EXPECT_EQ(e.reason, "loss diverging: 2001 is over 1000 times the run's best (2)");
  }
  fixture skip(guard_options().policy(policy::skip));  // a policy that does not roll back lets it be
  observe_calm(*skip.r, 5, 2.0);
  nanguard::step_event e;
  e.loss = 1e9;
  skip.r->observe_finite(e);
  EXPECT_FALSE(skip.r->running_away());
}

TEST(recovery, in_the_first_steps_a_loss_10_times_the_first_rolls_back) {
  fixture f;
  observe_calm(*f.r, 1, 0.73);
  nanguard::step_event e;
  e.loss = 7.2;  // under 10 times the first
  f.r->observe_finite(e);
  EXPECT_FALSE(f.r->running_away());
  e.loss = 11.3;  // AdamW at 100 times its stable LR, a transformer's second step
  f.r->observe_finite(e);
  ASSERT_TRUE(f.r->running_away());
  EXPECT_EQ(e.reason, "loss diverging from the start: 11.3 is over 10 times the first loss (0.73)");
  fixture later;  // once the run has a calm window, the rule is 1000 times its best
  observe_calm(*later.r, 6, 0.73);
  later.r->observe_finite(e);
  EXPECT_FALSE(later.r->running_away());
}

TEST(recovery, a_converged_loss_rising_orders_of_magnitude_below_the_first_is_no_runaway) {
  fixture f;
  observe_calm(*f.r, 1, 1.0);
  observe_calm(*f.r, 5, 1e-6);
  nanguard::step_event e;
  e.loss = 1e-2;  // 10^4 x the best, below the first loss
  f.r->observe_finite(e);
  EXPECT_FALSE(f.r->running_away());
}

TEST(recovery, only_a_calm_step_is_a_rollback_target) {
  fixture f;
  observe_calm(*f.r, 5, 2.0);
  nanguard::step_event e;
  e.loss = 19;
  e.grad_norm = 99;
  EXPECT_TRUE(f.r->calm(e));
  e.loss = 21;  // over 10x the best window's loss
  EXPECT_FALSE(f.r->calm(e));
  e.loss = 2;
  e.grad_norm = 101;  // over 100x its grad norm
  EXPECT_FALSE(f.r->calm(e));
  e.grad_norm = 1;
  e.spikes = {{"grad_norm", 1, 50}};
  EXPECT_FALSE(f.r->calm(e));
}

TEST(recovery, each_rollback_before_the_run_is_calm_again_cuts_the_lr_more) {
  fixture f(guard_options().rollback_lr_factor(0.5));
  nanguard::step_event e;
  EXPECT_EQ(f.r->roll_back(e), 0.5);
  EXPECT_EQ(f.r->roll_back(e), 0.25);
  EXPECT_EQ(f.r->roll_back(e), 0.125);
  EXPECT_EQ(f.r->lr_factor(), 0.5 * 0.25 * 0.125);
  f.r->snapshot(40);  // calm again
  EXPECT_EQ(f.r->roll_back(e), 0.5);
  EXPECT_EQ(f.r->roll_back(e, /*cut_lr=*/false), 1.0);  // bad data: the LR is kept
}

TEST(recovery, under_policy_rollback_bad_data_keeps_the_lr_and_a_quarantined_batch_is_skipped) {
  fixture f(guard_options().policy(policy::rollback));
  const nanguard::detail::decision first = f.r->decide(bad_step(cause::bad_data));
  EXPECT_EQ(first.policy, policy::rollback);
  EXPECT_FALSE(first.cut_lr);
  step_record again = bad_step(cause::bad_data);
  again.quarantined = true;
  EXPECT_EQ(f.r->decide(again).policy, policy::skip);
  EXPECT_TRUE(f.r->decide(bad_step(cause::log_of_nonpositive)).cut_lr);
}

TEST(recovery, a_spike_within_10_times_the_median_is_not_a_runaway) {
  fixture f;
  observe_calm(*f.r, 10);
  for (int i = 0; i < 5; ++i) {
    nanguard::step_event e;
    e.loss = 5.0;
    e.spikes = {{"loss", 5.0, 1e4}};
    f.r->observe_finite(e);
  }
  EXPECT_FALSE(f.r->running_away());
}

// ---- what stops a run, whatever the table says

TEST(recovery, max_bad_steps_in_a_row_abort_and_say_why) {
  fixture f(guard_options().max_bad_steps(4));
  for (int i = 0; i < 4; ++i) f.r->count_not_taken();
  const nanguard::detail::decision d = f.r->decide(bad_step(cause::bad_data));
  EXPECT_EQ(d.policy, policy::abort);
  EXPECT_EQ(d.note, "max_bad_steps=4: 4 bad steps in a row");
}

TEST(recovery, max_bad_fraction_of_the_recent_steps_aborts) {
  fixture f(guard_options().max_bad_fraction(0.5).max_bad_steps(0));
  for (int i = 0; i < 20; ++i) i % 3 == 0 ? f.r->count_taken() : f.r->count_not_taken();
  const nanguard::detail::decision d = f.r->decide(bad_step(cause::bad_data));
  EXPECT_EQ(d.policy, policy::abort);
  EXPECT_EQ(d.note, "max_bad_fraction=0.5: 13 of the last 20 steps were bad");
}

TEST(recovery, a_rollback_without_a_snapshot_that_fit_the_memory_budget_skips_and_says_why) {
  fixture f(guard_options().snapshot_memory_mb(1e-5));  // 10 bytes: the model's 12 do not fit
  EXPECT_TRUE(f.r->ring().empty());
  const nanguard::detail::decision d = f.r->decide(bad_step(cause::divergence));
  EXPECT_EQ(d.policy, policy::skip);
  EXPECT_EQ(d.note, "no snapshot to roll back to: a snapshot takes 12 B, over the memory budget of 10 B");
}

// ---- a policy the user names

TEST(recovery, a_named_policy_is_taken_for_every_cause) {
  for (policy p : {policy::skip, policy::backoff, policy::rollback, policy::abort}) {
    fixture f(guard_options().policy(p));
    for (cause c : nanguard::all_causes) EXPECT_EQ(f.r->decide(bad_step(c)).policy, p) << to_string(c);
  }
}

// ---- the rows' bookkeeping

TEST(recovery, a_batch_bad_twice_is_quarantined_and_not_replayed) {
  fixture f;
  step_record first = bad_step(cause::log_of_nonpositive);
  EXPECT_FALSE(f.r->quarantined(first));
  f.r->remember_bad_batch(first);
  step_record second = bad_step(cause::log_of_nonpositive);
  second.event.step = 15;
  EXPECT_FALSE(f.r->quarantined(second));
  f.r->remember_bad_batch(second);
  EXPECT_EQ(second.event.note, "batch quarantined (bad at step 7 and 15)");
  step_record third = bad_step(std::nullopt);
  EXPECT_TRUE(f.r->quarantined(third));
  ASSERT_EQ(third.event.findings.size(), 1u);  // the first time's findings stand
  EXPECT_EQ(third.event.findings[0].diagnosis.cause, cause::log_of_nonpositive);
  EXPECT_EQ(third.event.note, "quarantined batch (bad at step 7 first, 3 times now): not replayed");
  step_record other = bad_step(std::nullopt, nanguard::test::kNaN, /*x=*/2.0f);
  EXPECT_FALSE(f.r->quarantined(other));
}

TEST(recovery, bad_data_is_quarantined_the_first_time_and_a_divergence_never) {
  fixture f;
  step_record data = bad_step(cause::bad_data);
  f.r->remember_bad_batch(data);
  step_record again = bad_step(std::nullopt);
  EXPECT_TRUE(f.r->quarantined(again));
  step_record diverged = bad_step(cause::divergence, nanguard::test::kNaN, 3.0f);
  f.r->remember_bad_batch(diverged);
  f.r->remember_bad_batch(diverged);
  step_record diverged_again = bad_step(cause::divergence, nanguard::test::kNaN, 3.0f);
  EXPECT_FALSE(f.r->quarantined(diverged_again));
}

TEST(recovery, a_rollback_restores_the_snapshot_and_cuts_the_lr_factor) {
  fixture f(guard_options().rollback_lr_factor(0.25));
  const at::Tensor before = f.model->weight.detach().clone();
  {
    const at::NoGradGuard no_grad;
    f.model->weight.fill_(std::numeric_limits<float>::infinity());
  }
  nanguard::step_event e;
  EXPECT_EQ(f.r->roll_back(e), 0.25);
  EXPECT_TRUE(f.model->weight.detach().equal(before));
  EXPECT_EQ(e.rollback_to, 0);
  EXPECT_EQ(f.r->lr_factor(), 0.25);
  EXPECT_EQ(f.r->rollbacks(), 1);
  EXPECT_NE(e.note.find("moved most since the snapshot: weight (now non-finite)"), std::string::npos) << e.note;
}

}  // namespace
