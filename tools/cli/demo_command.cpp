// `nanguard demo`: shows what nanguard finds on built-in failure scenarios.
#include "commands.h"

#include <nanguard/census.h>

#include <ATen/ATen.h>
#include <fmt/format.h>

namespace nanguard::cli {
namespace {

struct scenario {
  const char* name;
  const char* what_happens;
  at::Tensor (*make)();
};

at::Tensor normalise_constant_feature() {
  const at::Tensor x = at::ones({64, 8});  // a zero-variance feature
  return (x - x.mean(0)) / x.std(0);
}

at::Tensor log_of_softmax() {
  at::Tensor logits = at::randn({16, 10}) * 3;
  logits.select(1, 0).fill_(120.0);  // one dominant class
  return at::log(at::softmax(logits, 1));
}

at::Tensor fp16_overflow() {
  const at::Tensor activations = at::randn({32, 256}) * 3e4;
  return (activations * 4).to(at::kHalf);
}

void show(const scenario& s) {
  const at::Tensor out = s.make();
  const tensor_stats st = census(out);
  fmt::print("\n== {} ==\n{}\n", s.name, s.what_happens);
  fmt::print("  has_nonfinite: {}\n  census: {}\n", has_nonfinite(out), to_string(st));
}

}  // namespace

command add_demo_command(CLI::App& app) {
  auto* sub = app.add_subcommand("demo", "Run the built-in failure scenarios and show the census");
  return {sub, [] {
            at::manual_seed(0);
            const scenario scenarios[] = {
                {"normalisation with std = 0", "(x - mean) / std over a constant feature: 0/0",
                 normalise_constant_feature},
                {"log(softmax(x)) underflow", "softmax underflows to 0 and log(0) is -inf",
                 log_of_softmax},
                {"fp16 overflow", "activations above 65504 become inf once cast to float16",
                 fp16_overflow},
            };
            for (const auto& s : scenarios) show(s);
            return exit_ok;
          }};
}

}  // namespace nanguard::cli
