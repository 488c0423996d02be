// Whole-step overhead of the training guard on the reference workload: a
// guarded step (loss check, sentinel pass, unscale + clip in one write, loss
// scaler, JSONL event line) against a plain step that already does
// clip_grad_norm_(1.0). All variants train the same model and optimizer,
// interleaved step by step in rotating order, so model placement and order
// effects cancel. Variants:
//   plain          zero_grad, forward, backward, clip_grad_norm_(1.0), AdamW
//   guarded        the guard as an fp32 run uses it: loss scaler disabled
//   guarded_scaled the guard with the loss scaler on at 2^16 (fp16 setting)
// Also times the gradient pass alone against LibTorch's clip_grad_norm_.
// Prints `plain_step_s`, `guarded_step_s`, `guarded_scaled_step_s`,
// `guard_ratio`, `guard_scaled_ratio`, the same in process CPU time
// (`guard_cpu_ratio`, ...), `sentinel_pass_ms`, `libtorch_clip_ms`.
// Usage: guard_bench [rounds]
#include "reference_workload.h"

#include <nanguard/clip.h>
#include <nanguard/guard.h>

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>

namespace {

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 16;
  at::set_num_threads(2);
  torch::manual_seed(0);
  nanguard::bench::reference_workload w;
  const std::string log = "/tmp/nanguard_guard_bench_" + std::to_string(::getpid());
  const auto options = [&](bool scaled) {
    return nanguard::guard_options()
        .max_norm(1.0)
        .scaler(nanguard::loss_scaler_options().enabled(scaled))  // GradScaler defaults when on
        .event_log(log + (scaled ? "_scaled.jsonl" : ".jsonl"));
  };
  nanguard::guard g(w.model, w.optimizer, options(false));
  nanguard::guard gs(w.model, w.optimizer, options(true));
  const std::vector<at::Tensor> batch{w.tokens, w.labels};
  const nanguard::step_fn fn = [&](const std::vector<at::Tensor>& b) {
    return torch::nn::functional::cross_entropy(w.model->forward(b[0]), b[1]);
  };
  int64_t skipped = 0;
  const std::vector<std::function<void()>> variants = {
      [&] { w.plain_step(); },
      [&] { skipped += g.step(batch, fn).skipped; },
      [&] { skipped += gs.step(batch, fn).skipped; },
  };
  for (const auto& v : variants) v();  // warm-up
  // Wall time, and process CPU time (all threads), which other processes on
  // a busy machine disturb much less.
  std::vector<std::vector<double>> t(variants.size()), cpu(variants.size());
  for (int r = 0; r < rounds; ++r)
    for (size_t k = 0; k < variants.size(); ++k) {
      const size_t i = (k + size_t(r)) % variants.size();
      const std::clock_t c0 = std::clock();
      t[i].push_back(nanguard::bench::seconds(variants[i]));
      cpu[i].push_back(double(std::clock() - c0) / CLOCKS_PER_SEC);
    }
  const double sp = median(t[0]), sg = median(t[1]), ss = median(t[2]);
  const double cp = median(cpu[0]), cg = median(cpu[1]), cs = median(cpu[2]);

  // The gradient pass alone, on the workload's real gradients.
  w.optimizer.zero_grad();
  w.loss().backward();
  const auto params = w.model->parameters();
  const auto pass = nanguard::bench::median_seconds(
      {[&] { nanguard::clip_grad_norm_(params, 1e9); },
       [&] { torch::nn::utils::clip_grad_norm_(params, 1e9); }},
      50);

  fmt::print("rounds: {} (median step time, same model, rotating order)\n", rounds);
  fmt::print("plain_step_s: {:.4f}\n", sp);
  fmt::print("guarded_step_s: {:.4f}\n", sg);
  fmt::print("guarded_scaled_step_s: {:.4f}\n", ss);
  fmt::print("guard_ratio: {:.3f}\n", sg / sp);
  fmt::print("guard_scaled_ratio: {:.3f}\n", ss / sp);
  fmt::print("plain_step_cpu_s: {:.4f}\n", cp);
  fmt::print("guarded_step_cpu_s: {:.4f}\n", cg);
  fmt::print("guard_cpu_ratio: {:.3f}\n", cg / cp);
  fmt::print("guard_scaled_cpu_ratio: {:.3f}\n", cs / cp);
  fmt::print("sentinel_pass_ms: {:.3f}\n", pass[0] * 1e3);
  fmt::print("libtorch_clip_ms: {:.3f}\n", pass[1] * 1e3);
  if (skipped) fmt::print("warning: the healthy workload skipped {} steps\n", skipped);
  std::remove((log + ".jsonl").c_str());
  std::remove((log + "_scaled.jsonl").c_str());
}
