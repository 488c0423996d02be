// Whole-step overhead of the training guard on the reference workload: a
// guarded step (loss check, sentinel pass, unscale + clip in one write, loss
// scaler, JSONL event line) against a plain step that already does
// clip_grad_norm_(1.0). All variants train the same model and optimizer,
// interleaved step by step in rotating order, so model placement and order
// effects cancel. Variants:
//   plain          zero_grad, forward, backward, clip_grad_norm_(1.0), AdamW
//   guarded        the guard as an fp32 run uses it: loss scaler disabled
//   guarded_scaled the guard with the loss scaler on at 2^16 (fp16 setting)
// Also prints the guard's own time per step (guard_own_ms, from its events:
// all of guard::step but forward, backward and optimizer step), its share of
// a plain step, and the gradient pass alone against LibTorch's
// clip_grad_norm_, which the guarded step does not run.
// Prints `plain_step_s`, `guarded_step_s`, `guarded_scaled_step_s`,
// `guard_ratio`, `guard_scaled_ratio` (median of per-round ratios, with
// their 95% intervals `..._ci95: low..high`), the same in process CPU time
// (`guard_cpu_ratio`, ...), system time and minor page faults per step
// (`plain_step_sys_s`, `guarded_step_page_faults`, ...), `guard_own_ms`, `guard_own_fraction`,
// `sentinel_pass_ms`, `libtorch_clip_ms`, `event_line_ms`.
// Usage: guard_bench [rounds]
#include "reference_workload.h"

#include <nanguard/clip.h>
#include <nanguard/events.h>
#include <nanguard/guard.h>

#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

// This process's CPU time (all threads) and minor page faults so far.
struct process_usage {
  double user_s, sys_s;
  long minor_faults;
  static process_usage now() {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    const auto s = [](const timeval& tv) { return double(tv.tv_sec) + double(tv.tv_usec) * 1e-6; };
    return {s(u.ru_utime), s(u.ru_stime), u.ru_minflt};
  }
};

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 24;
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
  int64_t skipped = 0, forecasts = 0;  // a healthy workload has neither
  std::vector<double> guard_ms;  // the guard's own time per step, from its events
  const std::vector<std::function<void()>> variants = {
      [&] { w.plain_step(); },
      [&] {
        const nanguard::step_event e = g.step(batch, fn);
        skipped += e.skipped;
        forecasts += e.forecast.has_value();
        guard_ms.push_back(e.guard_ms);
      },
      [&] {
        const nanguard::step_event e = gs.step(batch, fn);
        skipped += e.skipped;
        forecasts += e.forecast.has_value();
      },
  };
  for (const auto& v : variants) v();  // warm-up
  // Wall time, and process CPU time (all threads), which other processes on
  // a busy machine disturb much less; the CPU time split into user and
  // system time, with the page faults taken, to tell where extra CPU goes.
  std::vector<std::vector<double>> t(variants.size()), cpu(variants.size()), sys(variants.size()),
      faults(variants.size());
  for (int r = 0; r < rounds; ++r)
    for (size_t k = 0; k < variants.size(); ++k) {
      const size_t i = (k + size_t(r)) % variants.size();
      const process_usage u0 = process_usage::now();
      t[i].push_back(nanguard::bench::seconds(variants[i]));
      const process_usage u1 = process_usage::now();
      cpu[i].push_back(u1.user_s + u1.sys_s - u0.user_s - u0.sys_s);
      sys[i].push_back(u1.sys_s - u0.sys_s);
      faults[i].push_back(double(u1.minor_faults - u0.minor_faults));
    }
  using nanguard::bench::median;
  using nanguard::bench::paired_ratio;
  const auto guarded = paired_ratio(t[1], t[0]), scaled = paired_ratio(t[2], t[0]);

  // The gradient pass alone, on the workload's real gradients.
  w.optimizer.zero_grad();
  w.loss().backward();
  const auto params = w.model->parameters();
  const auto pass = nanguard::bench::median_seconds(
      {[&] { nanguard::clip_grad_norm_(params, 1e9); },
       [&] { torch::nn::utils::clip_grad_norm_(params, 1e9); }},
      50);

  // What one snapshot holds and costs (parameters, buffers, AdamW's moments).
  nanguard::module_host host(*w.model, w.optimizer);
  nanguard::snapshot_ring ring(host, 1);
  int64_t snapshot_step = 0;
  const double snapshot_s = nanguard::bench::median_seconds({[&] { ring.take(++snapshot_step); }}, 5)[0];

  // One event-log line as the guard writes it (the guard's time excludes it).
  nanguard::step_event typical = g.step(batch, fn);
  const std::string line_log = log + "_lines.jsonl";
  double event_line_s = 0;
  {
    nanguard::event_log lines(line_log, /*truncate=*/true);
    event_line_s = nanguard::bench::median_seconds({[&] { lines.write(typical); }}, 200)[0];
  }
  std::remove(line_log.c_str());

  fmt::print("rounds: {} (same model, rotating order; ratios: median of per-round ratios)\n", rounds);
  fmt::print("plain_step_s: {:.4f}\n", median(t[0]));
  fmt::print("guarded_step_s: {:.4f}\n", median(t[1]));
  fmt::print("guarded_scaled_step_s: {:.4f}\n", median(t[2]));
  fmt::print("guard_ratio: {:.3f}\n", guarded.median);
  fmt::print("guard_ratio_ci95: {:.3f}..{:.3f}\n", guarded.low, guarded.high);
  fmt::print("guard_scaled_ratio: {:.3f}\n", scaled.median);
  fmt::print("guard_scaled_ratio_ci95: {:.3f}..{:.3f}\n", scaled.low, scaled.high);
  fmt::print("plain_step_cpu_s: {:.4f}\n", median(cpu[0]));
  fmt::print("guarded_step_cpu_s: {:.4f}\n", median(cpu[1]));
  fmt::print("guard_cpu_ratio: {:.3f}\n", paired_ratio(cpu[1], cpu[0]).median);
  fmt::print("plain_step_sys_s: {:.4f}\n", median(sys[0]));
  fmt::print("guarded_step_sys_s: {:.4f}\n", median(sys[1]));
  fmt::print("plain_step_page_faults: {:.0f}\n", median(faults[0]));
  fmt::print("guarded_step_page_faults: {:.0f}\n", median(faults[1]));
  fmt::print("guard_scaled_cpu_ratio: {:.3f}\n", paired_ratio(cpu[2], cpu[0]).median);
  fmt::print("guard_own_ms: {:.3f}\n", median(guard_ms));
  fmt::print("guard_own_fraction: {:.4f}\n", median(guard_ms) / (median(t[0]) * 1e3));
  fmt::print("sentinel_pass_ms: {:.3f}\n", pass[0] * 1e3);
  fmt::print("libtorch_clip_ms: {:.3f}\n", pass[1] * 1e3);
  fmt::print("event_line_ms: {:.3f}\n", event_line_s * 1e3);
  fmt::print("healthy_steps_forecast: {}\n", forecasts);
  fmt::print("snapshot_bytes: {}\n", host.state_bytes());
  fmt::print("snapshot_ms: {:.3f}\n", snapshot_s * 1e3);
  if (skipped) fmt::print("warning: the healthy workload skipped {} steps\n", skipped);
  std::remove((log + ".jsonl").c_str());
  std::remove((log + "_scaled.jsonl").c_str());
}
