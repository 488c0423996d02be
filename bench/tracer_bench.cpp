// Whole-step overhead of the op tracer on the reference workload, measured
// side by side with a plain step, with autograd's DetectAnomalyGuard and with
// an empty observer (one that boxes the inputs and outputs of the ops the
// tracer sees and checks nothing: the tracer's floor). Prints `plain_step_s`,
// `tracer_step_s`, `anomaly_step_s`, `observer_step_s`, the ratios
// `tracer_ratio`, `anomaly_ratio` and `observer_ratio` (medians of per-round
// ratios) with their 95% intervals (`tracer_ratio_ci95: low..high`), and
// `tracer_over_observer_ratio`, what the tracer adds above that floor. Then
// the cost per op on a loop of small ops, where the step's other work does
// not hide it: `op_us` (plain), `record_function_op_us` (what an empty RecordFunction
// observer that asks for inputs and outputs adds: the floor of any op-level
// observer) and `tracer_op_us` (what the tracer adds). Last, from inside
// the tracer (tracer_options::measure_cost) on a few steps of the workload:
// `tracer_own_ms` per step (`tracer_scan_ms` of it reading tensors) and
// `tracer_own_fraction` of a plain step, with
// `record_function_floor_fraction`, what boxing the ops it saw costs.
// Usage: tracer_bench [rounds (default 40)] [plain|tracer|anomaly|observer]
// (naming a variant runs only it, `rounds` times: for a profiler).
#include "reference_workload.h"

#include <nanguard/tracer.h>

#include <ATen/record_function.h>
#include <fmt/format.h>

#include <cstdlib>
#include <cstring>

namespace {

// An observer that asks for every op's inputs and outputs and does nothing
// with them: what RecordFunction's boxing costs the tracer. Like the tracer,
// it turns itself off inside aten::bmm and aten::baddbmm, whose CPU kernels
// record a select and an mm per slice (three quarters of a training step's
// records, which the tracer checks through the bmm's output).
at::CallbackHandle empty_observer_handle = 0;

bool loops_over_slices(const at::RecordFunction& fn) {
  return std::strcmp(fn.name(), "aten::bmm") == 0 || std::strcmp(fn.name(), "aten::baddbmm") == 0;
}

at::RecordFunctionCallback empty_observer_callback() {
  return at::RecordFunctionCallback(
             [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
               if (loops_over_slices(fn)) at::disableCallback(empty_observer_handle);
               return nullptr;
             },
             [](const at::RecordFunction& fn, at::ObserverContext*) {
               if (loops_over_slices(fn)) at::reenableCallback(empty_observer_handle);
             })
      .needsInputs(true)
      .needsOutputs(true)
      .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION});
}

// Observes this thread's ops with the empty observer while it lives.
struct empty_observer {
  empty_observer() { empty_observer_handle = at::addThreadLocalCallback(empty_observer_callback()); }
  ~empty_observer() { at::removeCallback(empty_observer_handle); }
  empty_observer(const empty_observer&) = delete;
  empty_observer& operator=(const empty_observer&) = delete;
};

// Seconds per op of plain small ops, and what an empty observer and the
// tracer add to each, from `rounds` interleaved rounds (medians). Returns
// the empty observer's cost per op, in seconds.
double per_op_costs(int rounds) {
  const at::Tensor a = at::randn({64}), b = at::randn({64});
  constexpr int kIterations = 10000, kOpsPerIteration = 2;
  const auto ops = [&] {
    at::Tensor c = a;
    for (int i = 0; i < kIterations; ++i) c = at::add(c, b).mul_(0.5);
  };
  const auto observed = [&] {
    const empty_observer observer;
    ops();
  };
  const auto traced = [&] {
    nanguard::tracer t;
    ops();
  };
  const auto t = nanguard::bench::median_seconds({ops, observed, traced}, rounds);
  const double us_per_op = 1e6 / (kIterations * kOpsPerIteration);
  fmt::print("op_us: {:.3f}\n", t[0] * us_per_op);
  fmt::print("record_function_op_us: {:.3f}\n", (t[1] - t[0]) * us_per_op);
  fmt::print("tracer_op_us: {:.3f}\n", (t[2] - t[0]) * us_per_op);
  return (t[1] - t[0]) * us_per_op * 1e-6;
}

// The tracer's own time per step of the workload, measured inside its
// callbacks, next to the floor any op-level observer pays (RecordFunction
// boxing each op it reports), as fractions of a plain step.
void own_costs(nanguard::bench::reference_workload& w, double plain_step_s, double observer_s_per_op) {
  constexpr int kSteps = 8;
  nanguard::tracer t(nanguard::tracer_options().measure_cost(true));
  t.name_parameters(*w.model);
  for (int i = 0; i < kSteps; ++i) {
    t.set_step(i);  // as the guard does: what the tracer knew of the last step goes
    w.plain_step();
    t.keep_known_across_steps(w.optimizer);  // but AdamW's moments, which only AdamW writes
  }
  const nanguard::tracer_cost c = t.cost();
  const double own_s = c.seconds / kSteps, ops = double(c.ops) / kSteps;
  fmt::print("tracer_ops_per_step: {:.0f}\n", ops);
  fmt::print("tracer_scanned_mb_per_step: {:.1f}\n", double(c.scanned_bytes) / kSteps / 1e6);
  fmt::print("tracer_own_ms: {:.2f}\n", own_s * 1e3);
  fmt::print("tracer_scan_ms: {:.2f}\n", c.scan_seconds / kSteps * 1e3);
  fmt::print("tracer_own_fraction: {:.4f}\n", own_s / plain_step_s);
  fmt::print("record_function_floor_fraction: {:.4f}\n", ops * observer_s_per_op / plain_step_s);
  for (size_t i = 0; i < std::min<size_t>(c.scans_by_op.size(), 12); ++i)
    fmt::print("# scanned per step: {:7.2f} MB {:5.1f} scans  {}\n", double(c.scans_by_op[i].bytes) / kSteps / 1e6,
               double(c.scans_by_op[i].scans) / kSteps, c.scans_by_op[i].op);
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 40;  // with fewer the median moves ±2% run to run on a shared VM
  at::set_num_threads(2);
  torch::manual_seed(0);
  nanguard::bench::reference_workload w;
  int64_t findings = 0;

  const auto plain = [&] { w.plain_step(); };
  const auto traced = [&] {
    nanguard::tracer t;  // every forward and backward op checked, NaN and Inf
    t.name_parameters(*w.model);
    w.plain_step();
    t.keep_known_across_steps(w.optimizer);  // AdamW's moments: not read again next step
    findings += int64_t(t.findings().size());
  };
  const auto anomaly = [&] {
    torch::autograd::DetectAnomalyGuard guard;
    w.plain_step();
  };
  const auto observed = [&] {  // the floor: RecordFunction boxing the ops the tracer sees, nothing checked
    const empty_observer observer;
    w.plain_step();
  };
  const char* names[] = {"plain", "tracer", "anomaly", "observer"};
  const std::function<void()> variants[] = {plain, traced, anomaly, observed};
  if (argc > 2) {
    for (int i = 0; i < 4; ++i)
      if (std::strcmp(argv[2], names[i]) == 0) {
        fmt::print("{}_step_s: {:.4f}\n", names[i], nanguard::bench::median_seconds({variants[i]}, rounds)[0]);
        return 0;
      }
    return fmt::print(stderr, "tracer_bench: unknown variant '{}' (plain, tracer, anomaly, observer)\n", argv[2]), 2;
  }
  const auto t = nanguard::bench::interleaved_seconds({variants, variants + 4}, rounds);
  fmt::print("rounds: {} (variants interleaved, rotating order; ratios: median of per-round ratios)\n", rounds);
  for (int i = 0; i < 4; ++i) fmt::print("{}_step_s: {:.4f}\n", names[i], nanguard::bench::median(t[i]));
  const auto print_ratio = [](const std::string& key, const nanguard::bench::ratio_estimate& r) {
    fmt::print("{}: {:.3f}\n{}_ci95: {:.3f}..{:.3f}\n", key, r.median, key, r.low, r.high);
  };
  for (int i = 1; i < 4; ++i) print_ratio(fmt::format("{}_ratio", names[i]), nanguard::bench::paired_ratio(t[i], t[0]));
  // The tracer's own share: its step against the empty observer's.
  print_ratio("tracer_over_observer_ratio", nanguard::bench::paired_ratio(t[1], t[3]));
  if (findings != 0) fmt::print("warning: the healthy workload produced {} findings\n", findings);
  own_costs(w, nanguard::bench::median(t[0]), per_op_costs(21));
}
