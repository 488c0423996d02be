// scope.h: the module path the tracer names, from nested scopes, module
// children, Sequentials and TorchScript hierarchies.
#include "nanguard/scope.h"
#include "support.h"

#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/activation.h>

#include <string>
#include <thread>

namespace {

using nanguard::current_scope;
using nanguard::scope;
using nanguard::test::error_of;

// Records the scope each child runs in.
struct probe : torch::nn::Module {
  std::string seen;
  at::Tensor forward(const at::Tensor& x) {
    seen = current_scope();
    return x + 1;
  }
};

TEST(scope, nests_as_a_dotted_path_and_closes_in_order) {
  EXPECT_EQ(current_scope(), "");
  {
    NANGUARD_SCOPE("encoder.0");
    EXPECT_EQ(current_scope(), "encoder.0");
    {
      scope attn("attn");
      EXPECT_EQ(current_scope(), "encoder.0.attn");
    }
    EXPECT_EQ(current_scope(), "encoder.0");
  }
  EXPECT_EQ(current_scope(), "");
}

TEST(scope, an_empty_outer_scope_adds_no_dot) {
  scope top("");
  scope inner("head");
  EXPECT_EQ(current_scope(), "head");
}

TEST(scope, names_a_child_by_the_name_its_parent_registered) {
  torch::nn::ModuleList layers(torch::nn::Linear(2, 2), torch::nn::ReLU());
  {
    scope s(*layers, *layers[1]);
    EXPECT_EQ(current_scope(), "1");
  }
  torch::nn::ModuleDict heads(torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>{
      {"cls", torch::nn::Linear(2, 3).ptr()}, {"reg", torch::nn::Linear(2, 1).ptr()}});
  scope outer("model");
  scope s(*heads, *heads["reg"]);
  EXPECT_EQ(current_scope(), "model.reg");
}

TEST(scope, a_module_that_is_not_a_child_is_a_clear_error) {
  torch::nn::ModuleList layers(torch::nn::Linear(2, 2));
  torch::nn::Linear stranger(2, 2);
  const std::string msg = error_of([&] { scope s(*layers, *stranger); });
  EXPECT_NE(msg.find("not a child"), std::string::npos) << msg;
  EXPECT_NE(msg.find("register_module"), std::string::npos) << msg;
  EXPECT_EQ(current_scope(), "");  // nothing was left open
}

TEST(scope, forward_scoped_runs_each_child_of_a_sequential_under_its_name) {
  auto first = std::make_shared<probe>();
  auto second = std::make_shared<probe>();
  torch::nn::Sequential seq({{"embed", first}, {"out", second}});
  NANGUARD_SCOPE("net");
  const at::Tensor y = nanguard::forward_scoped(*seq, at::zeros({2}));
  EXPECT_EQ(first->seen, "net.embed");
  EXPECT_EQ(second->seen, "net.out");
  EXPECT_TRUE(at::equal(y, at::full({2}, 2.0)));
  EXPECT_EQ(current_scope(), "net");
}

TEST(scope, each_thread_has_its_own_stack) {
  NANGUARD_SCOPE("main");
  std::string other;
  std::thread([&] {
    NANGUARD_SCOPE("worker");
    other = current_scope();
  }).join();
  EXPECT_EQ(other, "worker");
  EXPECT_EQ(current_scope(), "main");
}

TEST(scope, dotted_module_path_drops_the_top_module_and_the_types) {
  EXPECT_EQ(nanguard::dotted_module_path({"TOP(M)::forward", "encoder(Enc)::forward", "norm(Norm)::forward"}),
            "encoder.norm");
  EXPECT_EQ(nanguard::dotted_module_path({"TOP(M)::forward"}), "");
  // A module calling a method of its own (nn.Conv2d's _conv_forward) stays that module.
  EXPECT_EQ(nanguard::dotted_module_path({"TOP(M)::forward", "conv(Conv2d)::forward", "SELF(Conv2d)::_conv_forward"}),
            "conv");
  EXPECT_EQ(nanguard::dotted_module_path({}), "");
  EXPECT_EQ(nanguard::dotted_module_path({"layers(ModuleList)::forward", "0(Block)::forward"}), "layers.0");
}

}  // namespace
