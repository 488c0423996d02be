// distributed.h in one process (a process group of one rank in a FileStore):
// the environment's errors, the consensus vector, averaging and its hook, the
// consistency check, broadcast, checksums, and the guard's distributed path
// (rank-tagged events and findings). The multi-rank behaviour is tested end to
// end by tests/cli/distributed_test.sh.
#include "nanguard/distributed.h"
#include "support.h"
#include "nanguard/guard.h"
#include "nanguard/tracer.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/torch.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <thread>

namespace {

using nanguard::test::error_of;

namespace fs = std::filesystem;

std::string fresh_store(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("nanguard_distributed_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p.string();
}

std::shared_ptr<nanguard::distributed> one_rank(const std::string& name, nanguard::distributed_options o = {}) {
  return std::make_shared<nanguard::distributed>(nanguard::init_process_group(fresh_store(name), 0, 1), o);
}

TEST(distributed, env_errors_name_the_variable) {
  ::unsetenv("RANK");
  ::setenv("WORLD_SIZE", "2", 1);
  ::unsetenv("MASTER_ADDR");
  EXPECT_NE(error_of([] { nanguard::init_process_group_from_env(); }).find("environment variable RANK is not set"),
            std::string::npos);
  ::setenv("RANK", "5", 1);
  EXPECT_NE(error_of([] { nanguard::init_process_group_from_env(); }).find("RANK='5' is not an integer in [0, 1]"),
            std::string::npos);
  ::setenv("RANK", "0", 1);
  EXPECT_NE(error_of([] { nanguard::init_process_group_from_env(); }).find("MASTER_ADDR is not set"),
            std::string::npos);
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  EXPECT_NE(error_of([] { nanguard::init_process_group_from_env(nanguard::process_group_options().timeout(0)); })
                .find("timeout must be > 0 seconds but is 0"),
            std::string::npos);
}

TEST(distributed, options_are_checked) {
  EXPECT_NE(error_of([] { one_rank("opt", nanguard::distributed_options().bucket_mb(0)); })
                .find("bucket_mb must be > 0 but is 0"),
            std::string::npos);
  EXPECT_NE(error_of([] { nanguard::distributed d{c10::intrusive_ptr<c10d::ProcessGroup>()}; }).find("the process group is null"), std::string::npos);
}

TEST(distributed, consensus_of_one_rank) {
  auto d = one_rank("consensus");
  EXPECT_EQ(d->rank(), 0);
  EXPECT_EQ(d->world_size(), 1);
  nanguard::consensus c = d->agree(false, 2.0, 0.25);
  EXPECT_TRUE(c.finite());
  EXPECT_EQ(c.grad_norm, 2.0);
  EXPECT_EQ(c.loss_sum, 0.25);
  c = d->agree(false, 1e200, 0.25);  // its square passes float64's range
  EXPECT_DOUBLE_EQ(c.grad_norm, 1e200);
  EXPECT_TRUE(std::isnan(d->agree(false, NAN, 0.25).grad_norm));
  c = d->agree(true, 2.0, 0.25);
  EXPECT_FALSE(c.finite());
  EXPECT_EQ(c.nonfinite_ranks, std::vector<int64_t>{0});
  EXPECT_EQ(c.grad_norm, 0.0);  // a bad rank's norm does not count
  EXPECT_EQ(d->broadcast("finding", 0), "finding");
  EXPECT_NE(error_of([&] { d->broadcast("x", 1); }).find("root 1 is not a rank in [0, 1)"), std::string::npos);
}

TEST(distributed, averaging_zeroes_missing_grads_and_calls_the_hook) {
  auto d = one_rank("average");
  at::Tensor a = torch::ones({3}, torch::requires_grad());
  at::Tensor b = torch::ones({2}, torch::requires_grad());
  (a * 2).sum().backward();
  int64_t seen = -1;
  d->on_averaged([&](int64_t step, const std::vector<at::Tensor>& params) {
    seen = step;
    params[0].grad()[0] = 7;
  });
  d->average_gradients_({a, b}, 9);
  EXPECT_EQ(seen, 9);
  ASSERT_TRUE(b.grad().defined());
  EXPECT_TRUE(b.grad().eq(0).all().item<bool>());
  EXPECT_EQ(a.grad()[0].item<float>(), 7.0f);
  EXPECT_TRUE(d->check_consistency({a, b}).empty());
}

// A killed rank's connections close before its process shows as exited, so
// a survivor's collective can fail first: exited_ranks() looks again for a
// while. Rank 1 here is a child process of this host that exits 0.2 s after
// the first look (what rank 1's own `distributed` would record is written
// for it).
TEST(distributed, exited_ranks_waits_for_a_dying_rank_of_this_host) {
  auto store = c10::make_intrusive<c10d::FileStore>(fresh_store("exited"), 2);
  const nanguard::distributed d(c10::make_intrusive<c10d::ProcessGroup>(store, 0, 2));
  int go[2];
  ASSERT_EQ(::pipe(go), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(go[1]);
    char c;
    while (::read(go[0], &c, 1) < 0) {}  // until the parent closes its end
    ::usleep(200000);
    ::_exit(0);
  }
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string record = std::string(host) + " " + std::to_string(child);
  store->set("nanguard/rank/1", std::vector<uint8_t>(record.begin(), record.end()));
  ::close(go[1]);
  const std::string exited = d.exited_ranks();
  ::close(go[0]);
  ::waitpid(child, nullptr, 0);
  EXPECT_EQ(exited, "rank 1 (host " + std::string(host) + ", pid " + std::to_string(child) + ") has exited");
}

TEST(distributed, checksum_sees_one_bit) {
  at::Tensor t = torch::randn({1000});
  const uint64_t before = nanguard::checksum({t});
  EXPECT_EQ(before, nanguard::checksum({t.clone()}));
  reinterpret_cast<uint32_t*>(t.data_ptr<float>())[517] ^= 1u;  // the lowest mantissa bit
  EXPECT_NE(before, nanguard::checksum({t}));
  EXPECT_NE(nanguard::checksum({t, t}), nanguard::checksum({t}));
}

TEST(distributed, guard_events_carry_the_rank) {
  torch::manual_seed(0);
  torch::nn::Linear model(4, 1);
  torch::optim::SGD opt(model->parameters(), 0.1);
  nanguard::guard g(model, opt, nanguard::guard_options().distributed(one_rank("guard")).max_norm(1.0));
  const auto fn = [&](const std::vector<at::Tensor>& b) { return model->forward(b[0].sqrt()).pow(2).mean(); };
  nanguard::step_event e = g.step({torch::ones({8, 4})}, fn);
  EXPECT_FALSE(e.skipped);
  EXPECT_EQ(e.rank, 0);
  EXPECT_TRUE(e.nonfinite_ranks.empty());
  at::Tensor x = torch::ones({8, 4});
  x[2][1] = -1;  // sqrt(-1) = nan: aten::sqrt is the producer
  e = g.step({x}, fn);
  EXPECT_TRUE(e.skipped);
  EXPECT_EQ(nanguard::action::skip, e.action);
  EXPECT_EQ(e.nonfinite_ranks, std::vector<int64_t>{0});
  ASSERT_FALSE(e.findings.empty());
  EXPECT_EQ(e.findings.front().op, "aten::sqrt");
  EXPECT_EQ(e.findings.front().rank, 0);
  EXPECT_EQ(nanguard::verdict::reproduced, e.verdict);
}

// A tracer on every step instead of a replay: its findings are shared and
// carry the rank as the replay's do.
TEST(distributed, traced_steps_share_their_findings) {
  torch::manual_seed(0);
  torch::nn::Linear model(4, 1);
  torch::optim::SGD opt(model->parameters(), 0.1);
  nanguard::guard g(model, opt, nanguard::guard_options().distributed(one_rank("traced")).replay(false)
                                    .trace_every_step(true).tracer(nanguard::tracer_options()));
  at::Tensor x = torch::ones({8, 4});
  x[2][1] = -1;
  const nanguard::step_event e =
      g.step({x}, [&](const std::vector<at::Tensor>& b) { return model->forward(b[0].sqrt()).pow(2).mean(); });
  EXPECT_TRUE(e.skipped);
  ASSERT_FALSE(e.findings.empty());
  EXPECT_EQ(e.findings.front().op, "aten::sqrt");
  EXPECT_EQ(e.findings.front().rank, 0) << "shared: tagged with the rank that saw it";
}

// Two ranks on two threads. A collective writes its tensors without a
// recorded op: the tracer on rank 0 must not trust what it knew of the
// bucket before the all-reduce brought rank 1's NaN into it.
TEST(distributed, a_tracer_sees_a_nan_that_arrives_through_the_all_reduce) {
  const std::string store = fresh_store("traced");
  std::vector<nanguard::finding> findings;
  const auto rank_main = [&](int64_t rank) {
    nanguard::distributed d(nanguard::init_process_group(store, rank, 2));
    at::Tensor w = torch::ones({4}, torch::requires_grad());
    std::unique_ptr<nanguard::tracer> t;
    if (rank == 0) t = std::make_unique<nanguard::tracer>();  // knows the gradient: all 2
    (w * 2).sum().backward();
    if (rank == 1) w.mutable_grad()[3] = NAN;
    d.average_gradients_({w}, 0);
    if (t) findings = t->findings();
  };
  std::thread other(rank_main, 1);
  rank_main(0);
  other.join();
  ASSERT_FALSE(findings.empty()) << "rank 1's NaN reached rank 0's gradient unseen";
  EXPECT_EQ("aten::mul_", findings.front().op);
  EXPECT_EQ(nanguard::role::input, findings.front().role);
  EXPECT_EQ("received via all-reduce (in place: as the op left it)", findings.front().culprit)
      << "another rank's values, not data (#38)";
  EXPECT_NE(nanguard::cause::bad_data, findings.front().diagnosis.cause);
}

// Three ranks on three threads (a majority to differ from); rank 1 changes
// a gradient after averaging at steps 2 and 3. A differing checksum is a bad
// step like a NaN: the policy acts on every rank (rollback, with its remedy)
// and it counts towards max_bad_steps (the second aborts).
TEST(distributed, a_differing_gradient_checksum_goes_through_the_policy) {
  const std::string store = fresh_store("checksum_policy");
  std::vector<nanguard::step_event> events[3];
  std::string errors[3];
  const auto rank_main = [&](int64_t rank) {
    auto d = std::make_shared<nanguard::distributed>(nanguard::init_process_group(store, rank, 3),
                                                     nanguard::distributed_options().check_every(1));
    if (rank == 1)
      d->on_averaged([](int64_t step, const std::vector<at::Tensor>& params) {
        if (step >= 2) params[0].grad().view(-1)[0].add_(1e-3);
      });
    torch::manual_seed(0);
    torch::nn::Linear model(4, 1);
    torch::optim::SGD opt(model->parameters(), 0.1);
    nanguard::guard g(model, opt, nanguard::guard_options().distributed(d).policy(nanguard::policy::rollback)
                                      .max_bad_steps(2).bundle_dir(""));
    const auto fn = [&](const std::vector<at::Tensor>& b) { return model->forward(b[0]).pow(2).mean(); };
    errors[rank] = error_of([&] {
      for (int i = 0; i < 3; ++i) events[rank].push_back(g.step({torch::ones({8, 4})}, fn));
    });
  };
  std::thread one(rank_main, 1), two(rank_main, 2);
  rank_main(0);
  one.join();
  two.join();
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(events[r].size(), 2u) << "rank " << r << ": " << errors[r];
    const nanguard::step_event& e = events[r][1];
    EXPECT_EQ(nanguard::action::rollback, e.action) << "rank " << r;
    EXPECT_TRUE(e.skipped);
    EXPECT_EQ(e.rollback_to, 0);
    EXPECT_EQ(e.reason, "gradient checksum differs on rank(s) 1");
    EXPECT_NE(e.note.find("gradient checksum differs after averaging on rank(s) 1"), std::string::npos) << e.note;
    EXPECT_NE(e.remedy.find("rolled back to the initial weights (the snapshot before step 1)"), std::string::npos) << e.remedy;
    EXPECT_NE(errors[r].find("gradient all-reduce"), std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

}  // namespace

// A c10d collective writes its tensors on the backend's thread, after the op
// returns and without a version bump. The tracer marks them written, so the
// next op that reads the tensor checks it instead of trusting the finite
// range it saw before. (Another rank's NaN is staged here by writing through
// the data pointer before a one-rank all-reduce, which leaves values as they are.)
TEST(distributed, a_trace_checks_what_a_collective_wrote) {
  auto pg = nanguard::init_process_group(fresh_store("collective_trace"), 0, 1);
  nanguard::tracer t;
  at::Tensor bucket = at::ones({8}) * 2;  // recorded: the tracer knows it is finite
  bucket.data_ptr<float>()[3] = std::nanf("");
  std::vector<at::Tensor> tensors{bucket};
  pg->allreduce(tensors)->wait();
  const at::Tensor grad = bucket * 0.5;
  ASSERT_TRUE(t.found()) << "the NaN the all-reduce delivered went unseen";
  EXPECT_EQ("aten::mul", t.findings().front().op);
  EXPECT_EQ(nanguard::role::input, t.findings().front().role);
  EXPECT_EQ("received via all-reduce", t.findings().front().culprit);
  EXPECT_TRUE(grad.isnan().any().item<bool>());
}
