// Per-step cost of the distributed guard's consensus on 2 ranks over
// loopback (Gloo): the one small all-reduce every guarded step adds (every
// rank's non-finite flag, squared grad norm and loss), against the step time
// of the reference workload (reference_workload.h) measured in the same run.
// The program forks its second rank itself; the ranks meet in a FileStore.
// Prints `consensus_ms` (median per step), `consensus_p90_ms`,
// `gradient_allreduce_ms` (the bucketed data-parallel averaging of the
// reference model's gradients: the data-parallel cost, not the guard's),
// `reference_step_ms` and `consensus_fraction` (consensus / reference step).
// Usage: distributed_bench [consensus_iterations] [reference_steps]
#include "reference_workload.h"

#include <nanguard/distributed.h>

#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace {

double median(std::vector<double> v, double q = 0.5) {
  const size_t k = std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

int run_rank(const std::string& store, int rank, int iterations, int reference_steps) {
  at::set_num_threads(2);
  auto pg = nanguard::init_process_group(store, rank, 2, nanguard::process_group_options().timeout(600));
  nanguard::distributed d(pg);

  // The consensus, as the guard calls it once per step.
  std::vector<double> times;
  for (int i = 0; i < 50; ++i) d.agree(false, 1.0, 0.5);
  for (int i = 0; i < iterations; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const nanguard::consensus c = d.agree(i % 97 == 0 && rank == 1, 1.0 + i, 0.5);
    times.push_back(ms_since(t0));
    if (c.grad_norm <= 0) std::abort();  // keep the result alive
  }

  // Data-parallel averaging of the reference model's gradients (both ranks).
  torch::manual_seed(0);
  nanguard::bench::reference_workload w;
  w.optimizer.zero_grad();
  w.loss().backward();
  std::vector<at::Tensor> params = w.model->parameters();
  std::vector<double> avg;
  for (int i = 0; i < 6; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    d.average_gradients_(params);
    avg.push_back(ms_since(t0));
  }

  // The reference step on rank 0 while rank 1 waits: one process's step time.
  std::vector<double> steps;
  if (rank == 0) {
    w.plain_step();
    for (int i = 0; i < reference_steps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      w.plain_step();
      steps.push_back(ms_since(t0));
    }
  }
  d.barrier();
  if (rank == 0) {
    const double consensus_ms = median(times);
    const double step_ms = median(steps);
    std::printf("consensus_iterations: %d\n", iterations);
    std::printf("consensus_ms: %.4f\n", consensus_ms);
    std::printf("consensus_p90_ms: %.4f\n", median(times, 0.9));
    std::printf("gradient_allreduce_ms: %.2f\n", median(avg));
    std::printf("reference_step_ms: %.1f\n", step_ms);
    std::printf("consensus_fraction: %.5f\n", consensus_ms / step_ms);
    std::printf("consensus_target: %s (<= 1 ms and <= 2%% of a reference step)\n",
                consensus_ms <= 1.0 && consensus_ms / step_ms <= 0.02 ? "met" : "MISSED");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const int iterations = argc > 1 ? std::atoi(argv[1]) : 2000;
  const int reference_steps = argc > 2 ? std::atoi(argv[2]) : 5;
  const std::string dir = fmt::format("{}/nanguard-dist-bench-{}", std::filesystem::temp_directory_path().string(),
                                      ::getpid());
  std::filesystem::create_directories(dir);
  const std::string store = dir + "/store";
  std::fflush(stdout);
  const pid_t child = ::fork();
  if (child < 0) {
    std::perror("fork");
    return 1;
  }
  int rc = 0;
  try {
    rc = run_rank(store, child == 0 ? 1 : 0, iterations, reference_steps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "distributed_bench: rank %d: %s\n", child == 0 ? 1 : 0, e.what());
    rc = 1;
  }
  if (child == 0) ::_exit(rc);
  int status = 0;
  ::waitpid(child, &status, 0);
  std::filesystem::remove_all(dir);
  return rc != 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0 ? 1 : 0;
}
