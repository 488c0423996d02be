// A planted fault (fault_injection.h) through the guard: a transient one is
// not reproduced by the replay, a persistent one is and is named at the op
// it corrupted, in the forward or the backward; bad specs are refused at
// set-up (#59).
#include "nanguard/fault_injection.h"
#include "nanguard/guard.h"

#include "support.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <optional>

namespace {

using nanguard::fault_kind;
using nanguard::fault_mode;
using nanguard::fault_spec;
using nanguard::guard;
using nanguard::guard_options;
using nanguard::step_event;

struct regression {
  torch::nn::Linear model{nullptr};
  at::Tensor x, y;
  regression() {
    torch::manual_seed(2);
    model = torch::nn::Linear(4, 1);
    x = torch::randn({16, 4});
    y = x.matmul(torch::randn({4, 1}));
  }
  nanguard::step_fn loss_fn() {
    return [this](const std::vector<at::Tensor>& b) { return (model->forward(b[0]) - b[1]).pow(2).mean(); };
  }
};

guard_options quiet_skip() {
  return guard_options().policy(nanguard::policy::skip).verbose(false).verify_remedies(false);
}

}  // namespace

TEST(fault_injection, a_spec_reads_back_from_its_text_and_a_bad_one_is_named) {
  const fault_spec s = nanguard::fault_spec_from_string(
      "op=aten::addmm,step=5,rank=1,direction=backward,occurrence=2,kind=bit_flip,bit=30,element=7,mode=persistent");
  EXPECT_EQ("aten::addmm", s.op());
  EXPECT_EQ(nanguard::direction::backward, s.direction());
  EXPECT_EQ(fault_kind::bit_flip, s.kind());
  EXPECT_EQ(fault_mode::persistent, s.mode());
  EXPECT_EQ("op=aten::addmm,step=5,rank=1,direction=backward,occurrence=2,kind=bit_flip,bit=30,element=7,"
            "mode=persistent",
            nanguard::to_string(s));
  EXPECT_EQ(nanguard::to_string(s), nanguard::to_string(nanguard::fault_spec_from_string(nanguard::to_string(s))));
  using nanguard::test::error_of;
  EXPECT_NE(std::string::npos, error_of([] { nanguard::fault_spec_from_string("op=aten::mm,stpe=3"); })
                                   .find("no field 'stpe'; the fields are op, step"));
  EXPECT_NE(std::string::npos, error_of([] { nanguard::fault_spec_from_string("step=3"); }).find("no op in 'step=3'"));
  EXPECT_NE(std::string::npos, error_of([] { nanguard::fault_spec_from_string("op=aten::mm,step=x"); })
                                   .find("step must be an integer but is 'x'"));
  EXPECT_NE(std::string::npos, error_of([] { nanguard::fault_spec_from_string("op=aten::mm,kind=zero"); })
                                   .find("fault_kind must be one of 'nan', 'inf', '-inf', 'bit_flip', 'scale'"));
}

TEST(fault_injection, a_bad_spec_is_refused_at_set_up) {
  regression r;
  torch::optim::SGD opt(r.model->parameters(), 0.1);
  guard g(r.model, opt, quiet_skip());
  using nanguard::test::error_of;
  EXPECT_NE(std::string::npos, error_of([&] { g.inject(fault_spec().op("aten::addmn")); })
                                   .find("'aten::addmn' is not an operator PyTorch knows"));
  EXPECT_NE(std::string::npos, error_of([&] { g.inject(fault_spec().op("aten::addmm").rank(2)); })
                                   .find("rank 2 is not in the guard's group of 1 process (rank 0)"));
  for (int i = 0; i < 3; ++i) g.step({r.x, r.y}, r.loss_fn());
  EXPECT_NE(std::string::npos, error_of([&] { g.inject(fault_spec().op("aten::addmm").step(2)); })
                                   .find("step 2 has passed (the last step was 3); name a step from 4 on"));
  g.inject(fault_spec().op("aten::addmm").step(4));
  EXPECT_NE(std::string::npos,
            error_of([&] { nanguard::fault_injector other(fault_spec().op("aten::mm")); }).find("another fault is armed"));
}

// The weights after `steps` guarded steps, with `spec` planted (none: a clean run).
struct run_result {
  std::vector<step_event> events;
  at::Tensor weight;
};
run_result guarded_run(int steps, const std::optional<fault_spec>& spec, guard_options options = quiet_skip()) {
  regression r;
  torch::optim::SGD opt(r.model->parameters(), 0.01);
  guard g(r.model, opt, options);
  if (spec) g.inject(*spec);
  run_result out;
  for (int i = 0; i < steps; ++i) out.events.push_back(g.step({r.x, r.y}, r.loss_fn()));
  out.weight = r.model->weight.detach().clone();
  return out;
}

TEST(fault_injection, a_transient_nan_is_not_reproduced_and_its_step_is_redone) {
  const run_result clean = guarded_run(5, std::nullopt);
  const run_result hit = guarded_run(5, fault_spec().op("aten::addmm").step(3).kind(fault_kind::nan));
  const step_event& e = hit.events[2];
  EXPECT_FALSE(e.skipped) << e.note;
  EXPECT_EQ(nanguard::verdict::not_reproduced, e.verdict);
  EXPECT_EQ(nanguard::fault_class::transient, e.fault);
  EXPECT_NE(std::string::npos,
            e.note.find("injected: nan written into [0, 0] of the output of aten::addmm (forward, call 0) at step 3"))
      << e.note;
  EXPECT_NE(std::string::npos, e.note.find("redone: the replay did not make the non-finite loss")) << e.note;
  EXPECT_EQ(clean.events[2].signature, e.signature) << "the step was taken as a clean run computes it";
  EXPECT_TRUE(torch::equal(clean.weight, hit.weight)) << "a transient fault costs the run nothing";
}

TEST(fault_injection, under_abort_a_transient_fault_still_stops_the_run) {
  EXPECT_THROW(guarded_run(5, fault_spec().op("aten::addmm").step(3),
                           quiet_skip().policy(nanguard::policy::abort).bundle_dir("")),
               nanguard::nonfinite_error);
}

// A finite fault: a value scaled by 1e4 makes the loss spike; the spike's
// second run differs, a third agrees with it, and the step is taken as they
// computed it.
TEST(fault_injection, a_transient_spike_is_caught_by_its_signature_and_redone) {
  const run_result clean = guarded_run(40, std::nullopt);
  const run_result hit =
      guarded_run(40, fault_spec().op("aten::addmm").step(30).kind(fault_kind::scale).factor(1e4).element(3));
  const step_event& e = hit.events[29];
  ASSERT_FALSE(e.spikes.empty()) << "the fault must make a spike for this test";
  EXPECT_FALSE(e.skipped);
  EXPECT_EQ(nanguard::fault_class::transient, e.fault) << e.note;
  EXPECT_NE(std::string::npos, e.note.find("redone: two more runs of the step from the same state agree")) << e.note;
  EXPECT_TRUE(torch::equal(clean.weight, hit.weight));
  const run_result unchecked = guarded_run(
      40, fault_spec().op("aten::addmm").step(30).kind(fault_kind::scale).factor(1e4).element(3),
      quiet_skip().replay_spikes(false));
  EXPECT_FALSE(torch::equal(clean.weight, unchecked.weight)) << "without the replay the corrupted step is taken";
}

// Corruption too small to spike: the audit's second run tells it.
TEST(fault_injection, the_audit_catches_a_fault_too_small_to_spike_and_nothing_on_healthy_steps) {
  const run_result clean = guarded_run(20, std::nullopt, quiet_skip().audit_every(1));
  for (const step_event& e : clean.events) EXPECT_EQ(nanguard::fault_class::none, e.fault) << e.step << ": " << e.note;
  const run_result hit = guarded_run(
      20, fault_spec().op("aten::addmm").step(10).kind(fault_kind::scale).factor(1.01), quiet_skip().audit_every(5));
  const step_event& e = hit.events[9];
  EXPECT_TRUE(e.spikes.empty());
  EXPECT_EQ(nanguard::fault_class::transient, e.fault) << e.note;
  EXPECT_TRUE(torch::equal(clean.weight, hit.weight));
}

TEST(fault_injection, a_persistent_fault_is_reproduced_and_named_at_its_op) {
  regression r;
  torch::optim::SGD opt(r.model->parameters(), 0.1);
  guard g(r.model, opt, quiet_skip());
  g.inject(fault_spec().op("aten::addmm").step(2).kind(fault_kind::pos_inf).element(5).mode(fault_mode::persistent));
  EXPECT_FALSE(g.step({r.x, r.y}, r.loss_fn()).skipped);
  for (int i = 0; i < 2; ++i) {
    const step_event e = g.step({r.x, r.y}, r.loss_fn());
    ASSERT_TRUE(e.skipped);
    EXPECT_EQ(nanguard::verdict::reproduced, e.verdict);
    EXPECT_EQ(nanguard::fault_class::model, e.fault) << "one process cannot tell a faulty unit from the model";
    ASSERT_FALSE(e.findings.empty());
    const nanguard::finding& f = e.findings.front();
    EXPECT_EQ("aten::addmm", f.op);
    EXPECT_EQ(nanguard::role::producer, f.role) << "its inputs were finite: the op made the Inf";
    EXPECT_EQ(5, f.index);
    EXPECT_EQ(HUGE_VAL, f.value);
  }
}

TEST(fault_injection, a_fault_in_the_backward_corrupts_the_gradients_only) {
  regression r;
  torch::optim::SGD opt(r.model->parameters(), 0.1);
  guard g(r.model, opt, quiet_skip());
  // Linear's weight gradient: aten::mm in the backward of aten::addmm.
  g.inject(fault_spec().op("aten::mm").step(1).direction(nanguard::direction::backward).mode(fault_mode::persistent));
  const step_event e = g.step({r.x, r.y}, r.loss_fn());
  ASSERT_TRUE(e.skipped);
  EXPECT_TRUE(std::isfinite(e.loss)) << "the forward is untouched";
  ASSERT_FALSE(e.findings.empty());
  EXPECT_EQ(nanguard::direction::backward, e.findings.front().direction);
  EXPECT_EQ("aten::mm", e.findings.front().op);
}

TEST(fault_injection, a_flipped_exponent_bit_makes_a_value_huge) {
  regression r;
  torch::optim::SGD opt(r.model->parameters(), 0.1);
  guard g(r.model, opt, quiet_skip());
  g.inject(fault_spec().op("aten::addmm").step(1).kind(fault_kind::bit_flip).bit(30));
  const step_event e = g.step({r.x, r.y}, r.loss_fn());
  // An output near 1 with its top exponent bit flipped is near 2^128: its square is Inf.
  EXPECT_EQ(nanguard::fault_class::transient, e.fault) << e.note;
  EXPECT_NE(std::string::npos, e.note.find("injected: bit_flip written into [0, 0]")) << e.note;
}

TEST(fault_injection, nanguard_inject_plants_a_fault_without_a_change_to_the_program) {
  regression r;
  torch::optim::SGD opt(r.model->parameters(), 0.1);
  ::setenv("NANGUARD_INJECT", "op=aten::addmm,step=2,kind=-inf", 1);
  step_event second;
  {
    guard g(r.model, opt, quiet_skip());
    g.step({r.x, r.y}, r.loss_fn());
    second = g.step({r.x, r.y}, r.loss_fn());
  }
  ::setenv("NANGUARD_INJECT", "op=aten::addmm,stp=2", 1);
  const std::string error = nanguard::test::error_of([&] { guard g(r.model, opt, quiet_skip()); });
  ::unsetenv("NANGUARD_INJECT");
  EXPECT_EQ(nanguard::fault_class::transient, second.fault);
  EXPECT_NE(std::string::npos, second.note.find("injected: -inf")) << second.note;
  EXPECT_NE(std::string::npos, error.find("nanguard::guard: NANGUARD_INJECT='op=aten::addmm,stp=2': ")) << error;
  EXPECT_NE(std::string::npos, error.find("no field 'stp'")) << error;
}
