// bench_util.h — runs Google Benchmark and keeps each run's time, so a bench
// program can print ratios measured side by side as `key: value` lines.
#pragma once

#include <benchmark/benchmark.h>

#include <map>
#include <string>

namespace nanguard::bench {

/// A console reporter that also remembers real time per iteration (ns).
class recording_reporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const auto& r : runs)
      if (r.run_type == Run::RT_Iteration && !r.error_occurred)
        ns_[r.benchmark_name()] = r.GetAdjustedRealTime();
    ConsoleReporter::ReportRuns(runs);
  }
  /// Time per iteration of the named benchmark, in its time unit.
  double time(const std::string& name) const { return ns_.at(name); }

 private:
  std::map<std::string, double> ns_;
};

}  // namespace nanguard::bench
