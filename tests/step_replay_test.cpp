// step_replay on its own: a bad step run again names its op from the same
// RNG state and leaves the RNG and the gradients as it found them; a step
// finite again is "not reproduced"; a step function that fails is "replay
// failed" with the reason; trace_every_step's live trace gives the step's
// own findings. Through the guard: guard_test.cpp and localization_test.cpp.
#include "guard/step_replay.h"

#include "support.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using nanguard::guard_options;
using nanguard::verdict;
using nanguard::detail::step_record;
using nanguard::detail::step_replay;

struct fixture {
  torch::nn::Linear model{2, 1};
  torch::optim::SGD optimizer{model->parameters(), torch::optim::SGDOptions(0.1)};
  nanguard::module_host host{*model, optimizer};
  guard_options options;
  nanguard::sentinel sentinel{model->named_parameters().pairs()};
  nanguard::loss_scaler scaler{options.scaler()};
  std::vector<std::string> names{"x"};
  nanguard::micro_batches batches;  // what record()'s step runs on
  step_replay replay{host, sentinel, scaler, options, names};

  explicit fixture(guard_options o = {}) : options(std::move(o)) {}

  // log(model(x)) of a batch: -inf where the model gives 0, NaN below.
  nanguard::step_fn log_loss() {
    return [this](const std::vector<at::Tensor>& b) { return model->forward(b[0]).log().sum(); };
  }
  // A record of a step on `x`, begun at the RNG state now.
  step_record record(const at::Tensor& x, nanguard::step_fn fn) {
    batches = {{x}};
    step_record r;
    r.batches = &batches;
    r.fn = std::move(fn);
    r.event.step = 3;
    r.rng_before = nanguard::detail::capture_generators();
    return r;
  }
  bool gradients_zero() const {
    for (const at::Tensor& p : model->parameters())
      if (p.grad().defined() && p.grad().count_nonzero().item<int64_t>() > 0) return false;
    return true;
  }
};

TEST(step_replay, a_bad_step_is_replayed_under_the_tracer_and_names_its_op) {
  fixture f;
  {
    const at::NoGradGuard no_grad;
    f.model->weight.fill_(1.0);
    f.model->bias.fill_(-1.0);  // x = (0.5, 0.5): the model gives 0, its log -inf
  }
  step_record r = f.record(torch::full({1, 2}, 0.5), f.log_loss());
  const at::Tensor rng_after = at::detail::getDefaultCPUGenerator().get_state();
  EXPECT_TRUE(f.replay.replay(r));  // this rank's own loss was not finite
  EXPECT_EQ(r.event.verdict, verdict::reproduced);
  ASSERT_FALSE(r.event.findings.empty());
  EXPECT_EQ(r.event.findings[0].op, "aten::log");
  EXPECT_EQ(r.event.findings[0].step, 3);
  EXPECT_EQ(r.bad_batch, 0u);
  EXPECT_TRUE(f.gradients_zero());
  EXPECT_TRUE(at::detail::getDefaultCPUGenerator().get_state().equal(rng_after));
}

TEST(step_replay, the_replay_draws_the_random_numbers_the_step_drew) {
  fixture f;
  std::vector<double> draws;
  step_record r = f.record(torch::ones({1, 2}), [&](const std::vector<at::Tensor>& b) {
    draws.push_back(torch::rand({1}).item<double>());
    return f.model->forward(b[0]).sum();
  });
  r.fn((*r.batches)[0]);  // the step itself
  f.replay.replay(r);
  ASSERT_EQ(draws.size(), 2u);
  EXPECT_EQ(draws[0], draws[1]);
}

TEST(step_replay, a_step_finite_again_is_not_reproduced) {
  fixture f;
  step_record r = f.record(torch::ones({1, 2}), [&](const std::vector<at::Tensor>& b) {
    return f.model->forward(b[0]).pow(2).sum();
  });
  EXPECT_FALSE(f.replay.replay(r));
  EXPECT_EQ(r.event.verdict, verdict::not_reproduced);
  EXPECT_TRUE(r.event.findings.empty());
}

TEST(step_replay, a_step_function_that_runs_backward_itself_fails_the_replay_and_says_why) {
  fixture f;
  step_record r = f.record(torch::ones({1, 2}), [&](const std::vector<at::Tensor>& b) {
    at::Tensor loss = f.model->forward(b[0]).sum();
    loss.backward({}, /*retain_graph=*/true);
    return loss;
  });
  f.replay.replay(r);
  EXPECT_EQ(r.event.verdict, verdict::replay_failed);
  EXPECT_NE(r.event.note.find("replay failed: nanguard::guard: the step function ran backward() itself"),
            std::string::npos) << r.event.note;
}

TEST(step_replay, the_live_trace_gives_the_steps_own_findings) {
  fixture f(guard_options().trace_every_step(true));
  const at::Tensor x = torch::full({1, 2}, NAN);
  f.replay.start_live_trace({{x}}, 5);
  f.log_loss()({x});
  nanguard::step_event e;
  f.replay.finish_live_trace(e);
  ASSERT_FALSE(e.findings.empty());
  EXPECT_EQ(e.findings[0].culprit, "x");  // named as the batch's tensor
  EXPECT_EQ(e.findings[0].step, 5);
}

}  // namespace
