// The data firewall's speed, 2 threads, 100k rows × 20 float columns:
//   csv_mb_per_s          read_csv of a numeric file written with %.7g (best of 5)
//   column_stats_mb_per_s the streaming statistics over the same data (float64 bytes)
//   firewall_mb_per_s     firewall.apply (impute_median + clip) on the same data
//   iforest_fit_s, iforest_score_s, iforest_fit_score_s
//                         isolation forest, 100 trees of 256 samples: fit, then
//                         score_samples of all 100k rows (best of 3)
// A plain timing program: each line is `key: value`.
#include <nanguard/column_stats.h>
#include <nanguard/csv.h>
#include <nanguard/firewall.h>
#include <nanguard/isolation_forest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>

#include <unistd.h>

namespace {

constexpr int64_t kRows = 100000, kCols = 20;

template <typename F>
double best_seconds(int reps, F&& fn) {
  double best = 1e300;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main() {
  at::set_num_threads(2);
  at::manual_seed(0);
  const at::Tensor x = at::randn({kRows, kCols}, at::kDouble);

  // ---- CSV
  const std::string path =
      (std::filesystem::temp_directory_path() / fmt::format("nanguard_data_bench_{}.csv", ::getpid())).string();
  {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    for (int64_t j = 0; j < kCols; ++j) std::fprintf(f, j ? ",f%ld" : "f%ld", long(j));
    std::fputc('\n', f);
    const double* v = x.data_ptr<double>();
    for (int64_t i = 0; i < kRows; ++i)
      for (int64_t j = 0; j < kCols; ++j) std::fprintf(f, j + 1 < kCols ? "%.7g," : "%.7g\n", v[i * kCols + j]);
    std::fclose(f);
  }
  const double mb = double(std::filesystem::file_size(path)) / 1e6;
  at::Tensor read;
  const double csv_s = best_seconds(5, [&] { read = nanguard::read_csv(path).data; });
  std::filesystem::remove(path);
  TORCH_CHECK(read.sizes() == x.sizes(), "data_bench: read back ", read.sizes());
  fmt::print("csv_file_mb: {:.1f}\n", mb);
  fmt::print("csv_mb_per_s: {:.0f}\n", mb / csv_s);

  // ---- statistics and firewall
  const double data_mb = double(x.numel()) * 8 / 1e6;
  nanguard::column_stats stats;
  const double stats_s = best_seconds(3, [&] {
    nanguard::column_stats s;
    for (int64_t b = 0; b < kRows; b += 8192) s.update(x.slice(0, b, std::min(b + 8192, kRows)));
    stats = std::move(s);
  });
  fmt::print("column_stats_mb_per_s: {:.0f}\n", data_mb / stats_s);
  nanguard::firewall fw(nanguard::firewall_options()
                            .nonfinite(nanguard::nonfinite_policy::impute_median)
                            .outliers(nanguard::outlier_policy::clip));
  fw.fit(stats);
  const double fw_s = best_seconds(3, [&] { (void)fw.apply(x); });
  fmt::print("firewall_mb_per_s: {:.0f}\n", data_mb / fw_s);

  // ---- isolation forest
  double fit_s = 1e300, score_s = 1e300, both_s = 1e300;
  for (int r = 0; r < 3; ++r) {
    nanguard::isolation_forest forest(nanguard::isolation_forest_options().seed(uint64_t(r)));
    const auto t0 = std::chrono::steady_clock::now();
    forest.fit(x);
    const auto t1 = std::chrono::steady_clock::now();
    const at::Tensor s = forest.score_samples(x);
    const auto t2 = std::chrono::steady_clock::now();
    TORCH_CHECK(s.numel() == kRows);
    fit_s = std::min(fit_s, std::chrono::duration<double>(t1 - t0).count());
    score_s = std::min(score_s, std::chrono::duration<double>(t2 - t1).count());
    both_s = std::min(both_s, std::chrono::duration<double>(t2 - t0).count());
  }
  fmt::print("iforest_fit_s: {:.3f}\n", fit_s);
  fmt::print("iforest_score_s: {:.3f}\n", score_s);
  fmt::print("iforest_fit_score_s: {:.3f}\n", both_s);
}
