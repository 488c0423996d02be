// Whole-step overhead of the training guard on the reference workload: a
// guarded step (loss check, sentinel pass, unscale + clip in one write, loss
// scaler, JSONL event line) side by side with a plain step that already does
// clip_grad_norm_(1.0). Also times the gradient pass alone against LibTorch's
// clip_grad_norm_. Prints `plain_step_s`, `guarded_step_s`, `guard_ratio`,
// `sentinel_pass_ms`, `libtorch_clip_ms`. Usage: guard_bench [rounds]
#include "reference_workload.h"

#include <nanguard/clip.h>
#include <nanguard/guard.h>

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 16;
  at::set_num_threads(2);
  torch::manual_seed(0);
  nanguard::bench::reference_workload plain_w;
  torch::manual_seed(0);
  nanguard::bench::reference_workload guarded_w;
  const std::string log = "/tmp/nanguard_guard_bench_" + std::to_string(::getpid()) + ".jsonl";
  nanguard::guard g(guarded_w.model, guarded_w.optimizer,
                    nanguard::guard_options()
                        .max_norm(1.0)
                        .scaler(nanguard::loss_scaler_options())  // GradScaler defaults, enabled
                        .event_log(log));
  const std::vector<at::Tensor> batch{guarded_w.tokens, guarded_w.labels};
  const nanguard::step_fn fn = [&](const std::vector<at::Tensor>& b) {
    return torch::nn::functional::cross_entropy(guarded_w.model->forward(b[0]), b[1]);
  };
  int64_t skipped = 0;
  const auto plain = [&] { plain_w.plain_step(); };
  const auto guarded = [&] { skipped += g.step(batch, fn).skipped; };
  const auto s = nanguard::bench::median_seconds({plain, guarded}, rounds);

  // The gradient pass alone, on the workload's real gradients.
  plain_w.optimizer.zero_grad();
  plain_w.loss().backward();
  const auto params = plain_w.model->parameters();
  const auto pass = nanguard::bench::median_seconds(
      {[&] { nanguard::clip_grad_norm_(params, 1e9); },
       [&] { torch::nn::utils::clip_grad_norm_(params, 1e9); }},
      50);

  fmt::print("rounds: {} (median step time, variants interleaved)\n", rounds);
  fmt::print("plain_step_s: {:.4f}\n", s[0]);
  fmt::print("guarded_step_s: {:.4f}\n", s[1]);
  fmt::print("guard_ratio: {:.3f}\n", s[1] / s[0]);
  fmt::print("sentinel_pass_ms: {:.3f}\n", pass[0] * 1e3);
  fmt::print("libtorch_clip_ms: {:.3f}\n", pass[1] * 1e3);
  if (skipped) fmt::print("warning: the healthy workload skipped {} steps\n", skipped);
  std::remove(log.c_str());
}
