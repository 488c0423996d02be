// Census throughput side by side with x.sum() and isfinite(x).all(), float32,
// 2^10 ... 2^26 elements, 2 threads: Google Benchmark's table, then the
// ratios at 2^20 ... 2^26 measured pairwise (two operations alternate in
// rounds of a few milliseconds each, and each ratio is the median of
// per-round ratios), and the headline ratios at 2^24:
//   census_vs_sum, census_vs_isfinite, has_nonfinite_vs_sum
// (throughput ratios: > 1 means faster than the baseline), with
// `census_vs_sum_ci95` and `has_nonfinite_vs_sum_ci95` intervals. Two more
// lines give census_vs_sum at 2^20 on gradient-like data, whose tiny values
// and zeros the census counts in a second pass over the sub-blocks holding
// them.
#include "bench_util.h"
#include "timing.h"

#include <nanguard/census.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

namespace {

at::Tensor data(int64_t n) {
  static std::map<int64_t, at::Tensor> cache;
  auto& t = cache[n];
  if (!t.defined()) t = at::randn({n});
  return t;
}

void set_bytes(benchmark::State& state, int64_t n) {
  state.SetBytesProcessed(state.iterations() * n * int64_t(sizeof(float)));
}

void bm_sum(benchmark::State& state) {
  const at::Tensor x = data(state.range(0));
  for (auto _ : state) benchmark::DoNotOptimize(x.sum().item<float>());
  set_bytes(state, x.numel());
}

void bm_isfinite_all(benchmark::State& state) {
  const at::Tensor x = data(state.range(0));
  for (auto _ : state) benchmark::DoNotOptimize(at::isfinite(x).all().item<bool>());
  set_bytes(state, x.numel());
}

void bm_census(benchmark::State& state) {
  const at::Tensor x = data(state.range(0));
  for (auto _ : state) benchmark::DoNotOptimize(nanguard::census(x));
  set_bytes(state, x.numel());
}

void bm_has_nonfinite(benchmark::State& state) {
  const at::Tensor x = data(state.range(0));
  for (auto _ : state) benchmark::DoNotOptimize(nanguard::has_nonfinite(x));
  set_bytes(state, x.numel());
}

void sizes(benchmark::internal::Benchmark* b) {
  for (int p = 10; p <= 26; p += 2) b->Arg(int64_t(1) << p);
  b->UseRealTime();
}

BENCHMARK(bm_sum)->Apply(sizes);
BENCHMARK(bm_isfinite_all)->Apply(sizes);
BENCHMARK(bm_census)->Apply(sizes);
BENCHMARK(bm_has_nonfinite)->Apply(sizes);

// Throughput ratio of `variant` to `baseline` (baseline time / variant time)
// from `rounds` rounds of the two side by side. Two at a time, so that each
// always follows the other: on tensors larger than the cache, what one call
// leaves in the cache changes the next one's time.
nanguard::bench::ratio_estimate throughput_ratio(const std::function<void()>& variant,
                                                 const std::function<void()>& baseline, int rounds) {
  const auto t = nanguard::bench::interleaved_seconds({variant, baseline}, rounds);
  return nanguard::bench::paired_ratio(t[1], t[0]);
}

// A callable that calls fn `times` times.
template <typename F>
std::function<void()> repeat(int64_t times, F fn) {
  return [times, fn] {
    for (int64_t i = 0; i < times; ++i) benchmark::DoNotOptimize(fn());
  };
}

// Calls per round for a tensor of n floats: about 4 ms of x.sum() at
// 100 GB/s, at least one call.
int64_t calls_per_round(int64_t n) {
  return std::max<int64_t>(1, int64_t(4e-3 * 100e9) / (n * int64_t(sizeof(float))));
}

nanguard::bench::ratio_estimate census_vs_sum(const at::Tensor& x, int rounds) {
  const int64_t calls = calls_per_round(x.numel());
  return throughput_ratio(repeat(calls, [&] { return nanguard::census(x).mean; }),
                          repeat(calls, [&] { return x.sum().item<float>(); }), rounds);
}

// Throughput ratios of census and has_nonfinite to sum and isfinite().all()
// on n elements.
struct ratios {
  nanguard::bench::ratio_estimate census_vs_sum, census_vs_isfinite, has_nonfinite_vs_sum;
};

ratios paired_ratios(int64_t n, int rounds) {
  const at::Tensor x = data(n);
  const int64_t calls = calls_per_round(n);
  const auto sum = [&] { return x.sum().item<float>(); };
  const auto census = [&] { return nanguard::census(x).mean; };
  const auto has_nonfinite = [&] { return nanguard::has_nonfinite(x); };
  const auto isfinite_all = [&] { return at::isfinite(x).all().item<bool>(); };
  // isfinite is some 30x slower: one call of it against 30 census calls.
  constexpr int64_t census_calls = 30;
  ratios r{census_vs_sum(x, rounds),
           throughput_ratio(repeat(census_calls, census), repeat(1, isfinite_all), rounds),
           throughput_ratio(repeat(calls, has_nonfinite), repeat(calls, sum), rounds)};
  // Those rounds ran census_calls censuses per isfinite: per call, census is that much faster.
  for (double* v : {&r.census_vs_isfinite.median, &r.census_vs_isfinite.low, &r.census_vs_isfinite.high})
    *v *= double(census_calls);
  return r;
}

// census_vs_sum on gradient-like data, where the census also counts the
// values below float16's smallest normal (and the zeros) that randn lacks.
void print_small_value_ratios() {
  const at::Tensor x = data(int64_t(1) << 20);
  const std::pair<const char*, at::Tensor> cases[] = {
      {"randn*1e-4 (46% below float16's smallest normal)", x * 1e-4},
      {"relu(randn)*1e-4 (50% zeros)", x.relu() * 1e-4}};
  for (const auto& [name, t] : cases) {
    const auto r = census_vs_sum(t, 21);
    fmt::print("2^20 {}: census_vs_sum {:.2f} ({:.2f}..{:.2f})\n", name, r.median, r.low, r.high);
  }
}

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(2);
  benchmark::Initialize(&argc, argv);
  nanguard::bench::recording_reporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  fmt::print("\npaired rounds (median of per-round throughput ratios, 95% interval):\n");
  ratios at24{};
  for (int p = 20; p <= 26; p += 2) {
    const ratios r = paired_ratios(int64_t(1) << p, 21);
    fmt::print("2^{}: census_vs_sum {:.2f} ({:.2f}..{:.2f})  census_vs_isfinite {:.1f}  "
               "has_nonfinite_vs_sum {:.2f} ({:.2f}..{:.2f})\n",
               p, r.census_vs_sum.median, r.census_vs_sum.low, r.census_vs_sum.high, r.census_vs_isfinite.median,
               r.has_nonfinite_vs_sum.median, r.has_nonfinite_vs_sum.low, r.has_nonfinite_vs_sum.high);
    if (p == 24) at24 = r;
  }
  print_small_value_ratios();
  fmt::print("census_vs_sum: {:.3f}\n", at24.census_vs_sum.median);
  fmt::print("census_vs_sum_ci95: {:.3f}..{:.3f}\n", at24.census_vs_sum.low, at24.census_vs_sum.high);
  fmt::print("census_vs_isfinite: {:.2f}\n", at24.census_vs_isfinite.median);
  fmt::print("has_nonfinite_vs_sum: {:.3f}\n", at24.has_nonfinite_vs_sum.median);
  fmt::print("has_nonfinite_vs_sum_ci95: {:.3f}..{:.3f}\n", at24.has_nonfinite_vs_sum.low,
             at24.has_nonfinite_vs_sum.high);
  benchmark::Shutdown();
}
