// `nanguard demo`: the classic ways training goes NaN, each run under the op
// tracer, which names the op, module, direction and role of the origin.
#include "commands.h"

#include <nanguard/census.h>
#include <nanguard/scope.h>
#include <nanguard/tracer.h>

#include <fmt/format.h>
#include <torch/torch.h>

namespace nanguard::cli {
namespace {

struct scenario {
  const char* name;
  const char* cause;
  void (*run)(tracer&);  // forward (and backward) of a tiny model
};

void zero_std_normalisation(tracer& t) {
  torch::nn::Linear lin(4, 4);
  t.name_parameters(*lin, "encoder");
  const at::Tensor h = lin(at::ones({8, 4}));  // every row alike: std over the batch is 0
  NANGUARD_SCOPE("norm");
  (h - h.mean(0, true)) / h.std(0, true, true);
}

void log_of_softmax(tracer&) {
  at::Tensor logits = at::randn({16, 10});
  logits.select(1, 0).fill_(150.0);  // one dominant class: the others underflow to 0
  NANGUARD_SCOPE("head");
  at::log(at::softmax(logits, 1));
}

void sqrt_backward(tracer&) {
  const at::Tensor x = torch::relu(torch::randn({32}, torch::requires_grad()));
  at::Tensor y;
  {
    NANGUARD_SCOPE("root");
    y = torch::sqrt(x).sum();  // finite forward; d sqrt/dx = 1 / (2 sqrt(0)) = inf
  }
  y.backward();
}

void nan_in_batch(tracer& t) {
  torch::nn::Linear lin(8, 4);
  t.name_parameters(*lin, "input_layer");
  at::Tensor batch;
  {
    tracer_pause loading(t);  // the data loader is not under study
    batch = at::randn({16, 8});
    batch[5][2] = NAN;  // a corrupt sample
  }
  t.name_tensor(batch, "batch");
  lin(batch);
}

void fully_masked_attention(tracer&) {
  const at::Tensor scores = at::randn({2, 4, 4});
  at::Tensor mask = at::zeros({2, 4, 4}, at::kBool);
  mask.select(2, 3).fill_(true);  // padding: fine, masked_fill's -inf is allowed
  mask[1][2].fill_(true);         // but query 2 of sample 1 sees no key at all
  NANGUARD_SCOPE("self_attn");
  at::softmax(scores.masked_fill(mask, -INFINITY), -1);
}

void fp16_overflow(tracer&) {
  const at::Tensor activations = at::randn({32, 256}) * 300;
  NANGUARD_SCOPE("mlp");
  (activations * activations).to(at::kHalf);  // 9e4 > 65504: inf in float16
}

void show(const scenario& s) {
  tracer t;
  t.set_step(0);
  s.run(t);
  fmt::print("\n== {} ==\n   cause: {}\n", s.name, s.cause);
  if (t.found()) fmt::print("{}", to_text(t.findings().front()));
  else fmt::print("   no non-finite value\n");
}

}  // namespace

command add_demo_command(CLI::App& app) {
  auto* sub = app.add_subcommand("demo", "Show where NaN/Inf is born in built-in failure scenarios");
  return {sub, [] {
            torch::manual_seed(0);
            torch::jit::setGraphExecutorOptimize(false);
            const scenario scenarios[] = {
                {"normalisation with std = 0", "(x - mean) / std over a constant feature is 0/0",
                 zero_std_normalisation},
                {"hand-written log(softmax(x))", "softmax underflows to 0 and log(0) is -inf",
                 log_of_softmax},
                {"sqrt at 0", "finite forward, infinite gradient in the backward pass", sqrt_backward},
                {"NaN in the data", "a corrupt sample enters the first layer", nan_in_batch},
                {"attention with a fully masked row", "softmax over a row of -inf is 0/0",
                 fully_masked_attention},
                {"float16 overflow", "activations above 65504 become inf once cast to float16",
                 fp16_overflow},
            };
            for (const auto& s : scenarios) show(s);
            return exit_ok;
          }};
}

}  // namespace nanguard::cli
