// rank_agreement on a process group of one rank (a FileStore): the
// consensus of a finite and a bad step, the averaged gradients measured
// again, the checksums when due, the findings shared with their rank, and
// the origin of a NaN/Inf under a backward collective. Two ranks end to
// end: tests/cli/distributed_test.sh and python/tests/test_guard_distributed.py.
#include "guard/rank_agreement.h"

#include "support.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <filesystem>

namespace {

using nanguard::backward_collective;
using nanguard::distributed_options;
using nanguard::guard_options;
using nanguard::detail::rank_agreement;
using nanguard::detail::step_record;

struct one_rank {
  torch::nn::Linear model{2, 1};
  std::shared_ptr<nanguard::distributed> group;
  guard_options options;
  nanguard::sentinel sentinel;
  nanguard::loss_scaler scaler;
  rank_agreement ranks;

  explicit one_rank(const std::string& name, distributed_options o = {})
      : group(std::make_shared<nanguard::distributed>(nanguard::init_process_group(store(name), 0, 1), o)),
        options(guard_options().distributed(group)),
        sentinel(model->named_parameters().pairs()),
        scaler(options.scaler()),
        ranks(*group, sentinel, scaler, options) {}

  static std::string store(const std::string& name) {
    const auto p = std::filesystem::temp_directory_path() /
                   ("nanguard_rank_agreement_test_" + name + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(p);
    return p.string();
  }

  // A measured step whose gradients are `g` everywhere.
  step_record measured(float g, double loss) {
    for (const at::Tensor& p : sentinel.parameters()) p.mutable_grad() = torch::full_like(p, g);
    step_record r;
    r.report = sentinel.inspect_grads();
    r.locally_finite = r.report.finite() && std::isfinite(loss);
    r.event.loss = loss;
    r.event.grad_norm = r.report.total_norm;
    return r;
  }
};

TEST(rank_agreement, a_finite_step_agrees_on_the_averaged_gradients_norm) {
  one_rank f("finite");
  step_record r = f.measured(2.0f, 0.5);
  ASSERT_TRUE(f.ranks.agree(r, 1));
  EXPECT_EQ(r.event.rank, 0);
  EXPECT_TRUE(r.event.nonfinite_ranks.empty());
  EXPECT_EQ(r.event.loss, 0.5);
  EXPECT_FLOAT_EQ(r.event.grad_norm, 2.0f * std::sqrt(3.0f));  // 3 elements of 2, averaged over one rank
  EXPECT_EQ(r.event.top_norms.size(), 2u);
}

TEST(rank_agreement, a_bad_step_names_the_rank) {
  one_rank f("bad");
  step_record r = f.measured(NAN, 0.5);
  EXPECT_FALSE(f.ranks.agree(r, 1));
  EXPECT_EQ(r.event.nonfinite_ranks, std::vector<int64_t>{0});
  EXPECT_EQ(r.event.reason, "non-finite on rank(s) 0");
  EXPECT_TRUE(rank_agreement::is_origin(r.event));
}

TEST(rank_agreement, checksums_are_compared_only_when_due) {
  one_rank f("checksums", distributed_options().check_every(2));
  step_record r = f.measured(1.0f, 0.5);
  EXPECT_TRUE(f.ranks.checksums_agree(r.event, 1));  // not due
  EXPECT_TRUE(f.ranks.checksums_agree(r.event, 2));  // due: one rank agrees with itself
  EXPECT_TRUE(r.event.reason.empty());
}

TEST(rank_agreement, shared_findings_carry_the_rank_and_the_verdict) {
  one_rank f("share");
  nanguard::step_event e;
  e.rank = 0;
  e.nonfinite_ranks = {0};
  e.verdict = nanguard::verdict::reproduced;
  e.note = "replayed";
  nanguard::finding finding;
  finding.op = "aten::log";
  e.findings = {finding};
  f.ranks.share_findings(e);
  ASSERT_EQ(e.findings.size(), 1u);
  EXPECT_EQ(e.findings[0].rank, 0);
  EXPECT_EQ(e.findings[0].op, "aten::log");
  EXPECT_EQ(e.verdict, nanguard::verdict::reproduced);
  EXPECT_EQ(e.note, "rank 0: replayed");
}

TEST(rank_agreement, the_origin_under_a_backward_collective_comes_from_the_replay) {
  one_rank f("origin", distributed_options().backward(backward_collective::all_reduce));
  nanguard::step_event e;
  e.rank = 0;
  f.ranks.name_origin(/*own_bad=*/true, e, 1);
  EXPECT_EQ(e.nonfinite_ranks, std::vector<int64_t>{0});
  EXPECT_EQ(e.reason, "non-finite gradients on rank(s) 0");
  nanguard::step_event overflow;
  f.ranks.name_origin(/*own_bad=*/false, overflow, 2);
  EXPECT_NE(overflow.note.find("although every rank's own were in the replay (overflow in the all-reduce)"),
            std::string::npos) << overflow.note;
  nanguard::step_event unknown;
  f.ranks.name_origin(std::nullopt, unknown, 3);
  EXPECT_NE(unknown.note.find("a replay (replay on, and guard.check's replay=) names the rank"), std::string::npos)
      << unknown.note;
}

TEST(rank_agreement, a_rank_that_received_the_nan_says_from_where) {
  one_rank f("received", distributed_options().backward(backward_collective::all_reduce));
  step_record r = f.measured(NAN, 0.5);
  r.event.rank = 0;
  r.event.nonfinite_ranks = {1};
  EXPECT_FALSE(rank_agreement::is_origin(r.event));
  f.ranks.note_received(r.report, r.event);
  EXPECT_NE(r.event.note.find("the NaN/Inf was received from rank 1 via all-reduce"), std::string::npos)
      << r.event.note;
}

}  // namespace
