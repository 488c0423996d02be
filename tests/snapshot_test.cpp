#include "nanguard/snapshot.h"

#include <fmt/format.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

void train_step(torch::nn::Module& m, torch::optim::Optimizer& o) {
  o.zero_grad();
  const auto x = torch::randn({8, 4});
  m.as<torch::nn::Sequential>()->forward(x).pow(2).mean().backward();
  o.step();
}

torch::nn::Sequential make() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::BatchNorm1d(8), torch::nn::Linear(8, 1));
}

template <typename Opt>
void restores_exactly(Opt& opt, torch::nn::Sequential& m) {
  nanguard::snapshot_ring ring(*m, opt, 2);
  train_step(*m, opt);
  ring.take(1);
  const auto params = m->parameters();
  std::vector<at::Tensor> saved;
  for (const auto& p : params) saved.push_back(p.clone());
  const auto buffers_saved = m->buffers()[0].clone();
  // Continue: the reference trajectory.
  torch::manual_seed(42);
  train_step(*m, opt);
  train_step(*m, opt);
  std::vector<at::Tensor> want;
  for (const auto& p : params) want.push_back(p.clone());
  EXPECT_EQ(1, ring.restore());
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::equal(saved[i], params[i])) << i;
  EXPECT_TRUE(at::equal(buffers_saved, m->buffers()[0]));
  // Same steps again from the restored state: same parameters, so the
  // optimizer state was restored deeply (not aliased to the live one).
  torch::manual_seed(42);
  train_step(*m, opt);
  train_step(*m, opt);
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(at::allclose(want[i], params[i], 1e-6, 1e-7)) << i;
}

TEST(snapshot, restores_parameters_buffers_and_adamw_state) {
  auto m = make();
  torch::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(1e-2));
  restores_exactly(opt, m);
}

TEST(snapshot, restores_sgd_momentum) {
  auto m = make();
  torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(1e-2).momentum(0.9));
  restores_exactly(opt, m);
}

TEST(snapshot, restores_an_empty_optimizer_state_and_keeps_the_lr) {
  auto m = make();
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-2));
  nanguard::snapshot_ring ring(*m, opt);
  ring.take(0);
  train_step(*m, opt);
  EXPECT_FALSE(opt.state().empty());
  opt.param_groups()[0].options().set_lr(5e-3);
  ring.restore();
  EXPECT_TRUE(opt.state().empty());
  EXPECT_EQ(5e-3, opt.param_groups()[0].options().get_lr());
}

TEST(snapshot, ring_keeps_the_newest_and_diff_ranks_the_diverged_layer_first) {
  auto m = make();
  torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1));
  nanguard::snapshot_ring ring(*m, opt, 2);
  for (int s : {10, 20, 30}) ring.take(s);
  EXPECT_EQ(2, ring.size());
  EXPECT_EQ(30, ring.newest_step());
  {
    torch::NoGradGuard ng;
    m[2]->as<torch::nn::Linear>()->weight.mul_(3);       // +200 %
    m[0]->as<torch::nn::Linear>()->weight.add_(1e-3);    // small
    m[0]->as<torch::nn::Linear>()->bias[0] = NAN;
  }
  const auto d = ring.diff();
  ASSERT_EQ(m->parameters().size(), d.size());
  EXPECT_EQ("0.bias", d[0].name);
  EXPECT_FALSE(d[0].finite);
  EXPECT_TRUE(std::isinf(d[0].relative));
  EXPECT_EQ("2.weight", d[1].name);
  EXPECT_NEAR(2.0, d[1].relative, 1e-5);
  EXPECT_EQ(0.0, d.back().relative);
  ring.drop_newest();
  EXPECT_EQ(20, ring.newest_step());
}

TEST(snapshot, restore_without_a_snapshot_says_what_to_do) {
  auto m = make();
  torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1));
  nanguard::snapshot_ring ring(*m, opt);
  try {
    ring.restore();
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string::npos, std::string(e.what()).find("no snapshot was taken yet; call take(step) first"));
  }
}

}  // namespace

namespace {

TEST(snapshot_ring, keeps_the_newest_and_one_per_far_window_besides) {
  torch::nn::Sequential m = make();
  torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1));
  nanguard::snapshot_ring ring(*m, opt, /*capacity=*/2, /*far_every=*/100);
  for (int64_t step = 0; step <= 300; step += 10) ring.take(step);
  EXPECT_EQ((std::vector<int64_t>{200, 290, 300}), ring.steps());
  ring.drop_newest();
  ring.drop_newest();
  EXPECT_EQ(200, ring.newest_step());  // a long divergence goes back further than the recent ones
  EXPECT_THROW(ring.take(150), c10::Error);  // not after the newest
  nanguard::snapshot_ring near_only(*m, opt, 2);
  for (int64_t step = 0; step <= 300; step += 10) near_only.take(step);
  EXPECT_EQ((std::vector<int64_t>{290, 300}), near_only.steps());
}

}  // namespace

namespace {

TEST(snapshot, state_bytes_counts_parameters_buffers_and_optimizer_state) {
  auto m = make();
  torch::optim::Adam opt(m->parameters(), torch::optim::AdamOptions(1e-3));
  nanguard::module_host host(*m, opt);
  int64_t params = 0, buffers = 0;
  for (const auto& p : m->parameters()) params += p.nbytes();
  for (const auto& b : m->buffers()) buffers += b.nbytes();
  EXPECT_EQ(params + buffers, host.state_bytes());  // no optimizer state before its first step
  train_step(*m, opt);
  EXPECT_EQ(3 * params + buffers, host.state_bytes());  // and Adam's two moments
}

TEST(snapshot, a_memory_budget_keeps_the_newest_that_fit_and_refuses_one_larger_than_all_of_it) {
  auto m = make();
  torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1));
  nanguard::module_host host(*m, opt);
  const int64_t one = host.state_bytes();
  nanguard::snapshot_ring ring(host, /*capacity=*/4);
  ring.set_memory_budget(2 * one + one / 2);  // two and a half snapshots
  for (int64_t step = 1; step <= 5; ++step) {
    EXPECT_TRUE(ring.take(step));
    EXPECT_LE(ring.held_bytes(), 2 * one + one / 2) << "step " << step;
  }
  EXPECT_EQ((std::vector<int64_t>{4, 5}), ring.steps());  // the oldest went first
  EXPECT_EQ("", ring.refusal());

  nanguard::snapshot_ring small(host, 2);
  small.set_memory_budget(one - 1);
  EXPECT_FALSE(small.take(1));
  EXPECT_TRUE(small.empty());
  EXPECT_EQ(0, small.held_bytes());
  EXPECT_EQ(fmt::format("a snapshot takes {} B, over the memory budget of {} B", one, one - 1), small.refusal());
}

}  // namespace
