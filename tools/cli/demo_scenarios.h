// demo_scenarios.h — the training problems of `nanguard demo`: one tiny
// model, data set, optimizer and loss for each classic way training goes
// NaN, built either with the bug (the unguarded run) or with its remedy.
#pragma once

#include <nanguard/diagnosis.h>
#include <nanguard/firewall.h>
#include <nanguard/guard.h>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace nanguard::cli {

/// One training run of a scenario, ready to step.
struct demo_setup {
  std::shared_ptr<torch::nn::Module> model;            ///< the tiny model
  std::unique_ptr<torch::optim::Optimizer> optimizer;  ///< a real optimizer over its parameters
  int64_t steps = 0;                                   ///< steps to train
  /// The batch of 1-based `step`: {inputs, targets}.
  std::function<std::vector<at::Tensor>(int64_t step)> batch;
  /// batch → scalar loss (forward only).
  step_fn loss;
  /// Unguarded run: a static loss scale (as fixed-scale fp16 training uses).
  double loss_scale = 1;
  /// Remedy run: the guard's options (the runner sets the event log and bundle dir).
  guard_options options;
  /// Remedy run: the firewall applied to the inputs (batch[0]) before each step.
  std::optional<firewall> data_firewall;
};

/// How a scenario's unguarded run watches the training.
enum class unguarded_mode {
  traced_loop,  ///< a guard with policy abort and a tracer on every step, as over a plain loop
  guard_abort,  ///< a guard with no remedy and policy abort: replay under the tracer, repro bundle
};

/// One classic failure, its remedy, and how to build both runs.
struct demo_scenario {
  std::string name;    ///< what --scenario takes, e.g. "zero-std"
  std::string title;   ///< e.g. "normalisation with std = 0"
  /// The diagnosis the unguarded run's first finding must get (why it goes non-finite).
  nanguard::cause expected = cause::unclassified;
  std::string remedy;  ///< what the remedy run changes
  std::string remedy_short;  ///< the remedy in a few words, for the summary table
  unguarded_mode mode = unguarded_mode::traced_loop;
  /// Builds the run: with the bug (false) or with the remedy (true). Seeds the
  /// RNG first, so both runs see the same data and the same initial model.
  std::function<demo_setup(bool remedy)> make;
  /// Another remedy run shown too ("" : none), e.g. "rollback", and what it does.
  std::string extra_name;
  std::string extra_remedy;  ///< what that run changes
  /// Builds that run.
  std::function<demo_setup()> make_extra;
};

/// The six scenarios, in the order the demo runs them.
std::vector<demo_scenario> demo_scenarios();

}  // namespace nanguard::cli
