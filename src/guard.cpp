#include "nanguard/guard.h"

#include "nanguard/bundle.h"
#include "nanguard/clip.h"
#include "nanguard/distributed.h"
#include "nanguard/training_host.h"

#include "detail/enum_from_string.h"
#include "detail/generator_states.h"
#include "detail/median.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/hash.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <nlohmann/json.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <mutex>
#include <numeric>
#include <string_view>
#include <unordered_map>

namespace nanguard {

namespace {

using step_clock = std::chrono::steady_clock;

// Prints one of the guard's lines on stderr after what the program printed
// on stdout before it: piped or written to a log, stdout is buffered, and
// the line would land pages ahead of the output it follows.
void say(const std::string& line) {
  std::fflush(stdout);
  fmt::print(stderr, "{}\n", line);
}

// How findings name the i-th tensor of the batch: its name in `names`, else
// its position.
std::string batch_name(const std::vector<std::string>& names, size_t i) {
  return i < names.size() && !names[i].empty() ? names[i] : "batch[" + std::to_string(i) + "]";
}

// The action of a bad step that policy `p` acted on (auto has chosen one of the others).
action action_of(policy p) {
  switch (p) {
    case policy::automatic: break;
    case policy::skip: return action::skip;
    case policy::backoff: return action::backoff;
    case policy::rollback: return action::rollback;
    case policy::abort: return action::abort;
  }
  TORCH_INTERNAL_ASSERT(false, "nanguard: policy ", static_cast<int>(p), " has no action");
}

// What the guard did about a bad step: skipped or rolled back, and how the
// LR and the loss scale changed.
std::string applied_remedy(const step_event& e, double lr_after, double scale_after) {
  std::string r = e.action != action::rollback ? "skipped the step"
                  : e.rollback_to == 0          ? "rolled back to the snapshot of step 0 (the initial weights)"
                                                : fmt::format("rolled back to the snapshot of step {}", e.rollback_to);
  if (lr_after != e.lr) r += fmt::format("; lr {:.6g} -> {:.6g}", e.lr, lr_after);
  if (scale_after != e.scale) r += fmt::format("; loss scale {:.6g} -> {:.6g}", e.scale, scale_after);
  return r;
}

// "moved most since the snapshot: fc.weight (x3.2) fc.bias (by 0.031 from 0)": the
// first 3 changes, each relative to the parameter's norm then, or absolute
// where that norm is ~0 (a zero-initialised bias: any move is a ratio of 1e10),
// listed after the others.
std::string moved_most(std::vector<param_change> changes) {
  std::stable_partition(changes.begin(), changes.end(),
                        [](const param_change& c) { return !c.finite || c.norm_then > 1e-6; });
  std::string moved = "moved most since the snapshot:";
  for (size_t i = 0; i < changes.size() && i < 3; ++i) {
    const param_change& c = changes[i];
    moved += " " + c.name;
    if (!c.finite) moved += " (now non-finite)";
    else if (c.norm_then > 1e-6) moved += fmt::format(" (x{:.3g})", c.relative);
    else moved += fmt::format(" (by {:.3g} from {:.3g})", c.absolute, c.norm_then);
  }
  return moved;
}

// "1, 3".
std::string rank_list(const std::vector<int64_t>& ranks) {
  return fmt::format("{}", fmt::join(ranks, ", "));
}

// The one line an error says: a c10::Error's message without its backtrace.
std::string message_of(const std::exception& ex) {
  const auto* error = dynamic_cast<const c10::Error*>(&ex);
  return error ? error->what_without_backtrace() : ex.what();
}

// Adds `note` to a step's notes, "; " between two.
void add_note(std::string& notes, const std::string& note) {
  if (!notes.empty()) notes += "; ";
  notes += note;
}

double seconds_since(step_clock::time_point start) {
  return std::chrono::duration<double>(step_clock::now() - start).count();
}

// Adds the seconds it lives to `total`: the work of a step that a plain
// loop does too, subtracted from the guard's own time.
class user_time {
 public:
  explicit user_time(double& total) : total_(total) {}
  ~user_time() { total_ += seconds_since(start_); }
  user_time(const user_time&) = delete;
  user_time& operator=(const user_time&) = delete;

 private:
  double& total_;
  step_clock::time_point start_ = step_clock::now();
};

// A micro-batch's share of the step's loss: the mean over `n` micro-batches
// is the gradient of the whole batch (one micro-batch: the loss itself).
at::Tensor share_of(const at::Tensor& loss, size_t n) { return n == 1 ? loss : loss / double(n); }

// A batch's fingerprint: the shapes, dtypes and bytes of its tensors (a
// CUDA tensor is copied to the CPU for it: only bad steps read it). None
// for a batch with no tensor.
std::optional<uint64_t> fingerprint(const std::vector<std::vector<at::Tensor>>& batches) {
  size_t h = 0;
  bool any = false;
  for (const auto& batch : batches)
    for (const at::Tensor& t : batch) {
      if (!t.defined()) continue;
      any = true;
      const at::Tensor c = t.detach().cpu().contiguous();
      h = c10::hash_combine(h, static_cast<size_t>(c.scalar_type()));
      for (int64_t d : c.sizes()) h = c10::hash_combine(h, static_cast<size_t>(d));
      if (c.layout() == at::kStrided)
        h = c10::hash_combine(h, std::hash<std::string_view>{}(std::string_view(
                                     static_cast<const char*>(c.data_ptr()), c.nbytes())));
    }
  if (!any) return std::nullopt;
  return h;
}

// The host's traced run (its module scopes, a compiled model run eagerly),
// begun while it lives (a replay that throws ends it too).
class traced_run {
 public:
  explicit traced_run(training_host& host) : end_(host.begin_traced_run()) {}
  ~traced_run() {
    if (end_) end_();
  }
  traced_run(const traced_run&) = delete;
  traced_run& operator=(const traced_run&) = delete;

 private:
  std::function<void()> end_;
};

}  // namespace

const char* to_string(policy p) {
  switch (p) {
    case policy::automatic: return "auto";
    case policy::skip: return "skip";
    case policy::backoff: return "backoff";
    case policy::rollback: return "rollback";
    case policy::abort: return "abort";
  }
  TORCH_INTERNAL_ASSERT(false, "nanguard: policy ", static_cast<int>(p), " has no name");
}

policy policy_from_string(const std::string& name) {
  return detail::enum_from_string(name, all_policies, "policy");
}

namespace {

// The `k` largest norms with their names, largest first.
std::vector<std::pair<std::string, double>> top_norms(const std::vector<std::string>& names,
                                                      const std::vector<double>& norms, int64_t k) {
  // NaN sorts first (a strict weak order needs it placed somewhere).
  const auto key = [](double v) { return std::isnan(v) ? HUGE_VAL : v; };
  std::vector<size_t> order(norms.size());
  std::iota(order.begin(), order.end(), size_t(0));
  const size_t n = std::min(order.size(), static_cast<size_t>(std::max<int64_t>(k, 0)));
  std::partial_sort(order.begin(), order.begin() + n, order.end(),
                    [&](size_t a, size_t b) { return key(norms[a]) > key(norms[b]); });
  std::vector<std::pair<std::string, double>> out;
  for (size_t i = 0; i < n; ++i) out.emplace_back(names[order[i]], norms[order[i]]);
  return out;
}

}  // namespace

struct guard::impl {
  using micro_batches = guard::micro_batches;

  impl(std::shared_ptr<training_host> h, guard_options opts)
      : host(std::move(h)), options(std::move(opts)),
        scaler(options.scaler()),
        sentinel(host->named_parameters(), options.spikes()),
        ring(*host, options.snapshot_keep(), 10 * options.snapshot_every()) {}

  std::shared_ptr<training_host> host;
  guard_options options;
  loss_scaler scaler;
  nanguard::sentinel sentinel;
  snapshot_ring ring;
  std::optional<warmup_cosine> schedule;
  std::unique_ptr<event_log> log;
  int64_t step = 0;
  int64_t skipped = 0;
  int64_t rollbacks = 0;
  int64_t bad_in_a_row = 0;
  double lr_factor = 1.0;
  step_clock::time_point step_started;  // of the step being run
  double user_s = 0;                    // its seconds of plain-loop work (see user_time)
  step_clock::time_point begun;         // when begin_step() returned: the user's forward and backward run until check()
  bool snapshot_pending = false;
  int64_t restored_step = -1;  // the snapshot the last rollback restored
  // Snapshots: the steps to the next (snapshot_every, or up to 10 times
  // more when one costs more than its budget; 0: to be measured), the step
  // of the last, what it cost and how long a step takes. The budget: 0.2%
  // of the steps' time; a snapshot under 1 ms (a small model's) always fits.
  int64_t snapshot_interval = 0;
  int64_t last_snapshot = 0;
  double snapshot_s = 0;
  double step_s = 0;
  static constexpr double snapshot_budget = 0.002, snapshot_always_s = 1e-3;
  // auto: the batches that went bad (by fingerprint), how often, and the
  // findings of the first time; one that went bad twice, or with bad data,
  // is quarantined: skipped when it goes bad again, without a replay.
  struct bad_batch_record {
    int64_t first_step = 0;
    int64_t times = 0;
    bool quarantined = false;
    std::vector<finding> findings;
  };
  std::unordered_map<uint64_t, bad_batch_record> bad_batches;
  // Whether each of the last max_bad_window steps was bad (max_bad_fraction).
  std::deque<bool> recent_bad;
  static constexpr int64_t max_bad_window = 100, max_bad_min_steps = 20;
  int64_t spiking = 0;  // steps in a row whose loss spiked by spike_rollback_z
  // Finite steps since the start or the last rollback: a snapshot waits
  // until the spike windows hold enough of them to tell a calm step.
  int64_t steps_observed = 0;
  // Losses and grad norms of the last finite steps (a spike window of
  // them): what a bad step's diagnosis reads as the steps before.
  std::deque<double> losses, grad_norms;
  // The step begin_step() started for check(), the RNG state and the
  // gradients then (gradient_marks: has a backward run since?).
  std::optional<step_event> started;
  detail::generator_states started_rng;
  std::vector<std::pair<const void*, int64_t>> started_gradients;
  // trace_every_step: the tracer of the step's forward and backward, and
  // the host's traced run it attributes ops by.
  std::optional<tracer> live;
  std::optional<traced_run> live_run;
  bundle_tag_list bundle_tags = options.bundle_tags();
  std::vector<std::string> batch_names;  // set_batch_names
  std::optional<step_event> last;  // the last step's event
  run_narrator narrator;            // tells the user (options.verbose)
  bool running = false;             // a step (or check) is under way

  // The collective the model's own backward runs (DDP, FSDP2), or none.
  backward_collective collective() const {
    return options.distributed() ? options.distributed()->options().backward() : backward_collective::none;
  }

  // The LR of the first param group (0 when there is none).
  double first_lr() const {
    const std::vector<double> lrs = host->lrs();
    return lrs.empty() ? 0.0 : lrs.front();
  }

  // Sets every param group's LR to the schedule's for this step, times the
  // rollback factors.
  void apply_schedule() {
    host->set_lrs(std::vector<double>(host->lrs().size(), schedule->lr(step - 1) * lr_factor));
  }

  // Remembers a finite step for the diagnosis of a later bad one.
  void remember(const step_event& e) {
    losses.push_back(e.loss);
    grad_norms.push_back(e.grad_norm);
    if (int64_t(losses.size()) > options.spikes().window()) {
      losses.pop_front();
      grad_norms.pop_front();
    }
  }

  // What the guard knows of the bad step `e` besides its findings.
  diagnosis_context history(const step_event& e, const std::vector<at::Tensor>& batch) const {
    diagnosis_context c;
    c.losses.assign(losses.begin(), losses.end());
    if (std::isfinite(e.loss)) c.losses.push_back(e.loss);  // a finite loss, gradients not
    c.grad_norms.assign(grad_norms.begin(), grad_norms.end());
    c.lr = e.lr;
    c.loss_scale = e.scale;
    for (size_t i = 0; i < batch.size(); ++i) c.data.push_back(batch_name(batch_names, i));
    c.front_end = options.front_end();
    c.data_file = options.data_file();
    return c;
  }

  // Stamps the guard's own time so far on `e` and logs it; a bad step is a
  // warning on stderr too (verbose; distributed: rank 0's).
  void write(step_event& e) {
    e.guard_ms = (seconds_since(step_started) - user_s) * 1e3;
    last = e;
    if (log) log->write(e);
    const std::string& warning = narrator.observe(e);
    if (!warning.empty() && speaks(e)) say(warning);
  }

  // Whether this guard prints to the user what happened at step `e`.
  bool speaks(const step_event& e) const { return options.verbose() && e.rank <= 0; }

  // trace_every_step: starts the tracer of this step's forward and backward,
  // naming what a replay's tracer names (`batches`: none when a framework
  // runs the step).
  void start_trace(const micro_batches& batches) {
    if (!options.trace_every_step()) return;
    live_run.reset();
    live.reset();  // a step begun and never checked
    live.emplace(options.tracer());
    prepare(*live, batches, step);
    live_run.emplace(*host);
  }

  // Tags a tracer's findings with step `number` and names what they may
  // name: the parameters and the tensors of every micro-batch.
  void prepare(tracer& t, const micro_batches& batches, int64_t number) const {
    t.name_parameters(host->named_parameters());
    t.set_step(number);
    for (const auto& batch : batches)
      for (size_t j = 0; j < batch.size(); ++j)
        if (batch[j].defined()) t.name_tensor(batch[j], batch_name(batch_names, j));
  }

  // Ends it: its findings are the step's.
  void finish_trace(step_event& e) {
    if (!live) return;
    live_run.reset();
    e.findings = live->findings();
    live.reset();
  }

  // Runs the step again from the same RNG state, under the tracer; fills the
  // event's findings and verdict, and `bad_batch` with the micro-batch in
  // which the tracer found the first. Leaves gradients zeroed and the RNG
  // where the original step left it. Returns whether this rank's own loss
  // or gradients (before a backward collective) were not finite in it.
  bool replay(const micro_batches& batches, const step_fn& fn, const detail::generator_states& rng_before,
              size_t& bad_batch, step_event& e) {
    const detail::generator_states rng_after = detail::capture_generators();
    host->zero_grad();
    detail::restore_generators(rng_before);
    bool reproduced = false, failed = false, own_bad = false;
    try {
      tracer t(tracer_options(options.tracer()).keep_inputs(true));  // the bundle's culprit inputs
      prepare(t, batches, e.step);
      const traced_run run(*host);
      // Under a backward collective every micro-batch runs on every rank,
      // whatever this rank's tracer found: the other ranks' collectives wait for it.
      const bool collective_replay = collective() != backward_collective::none;
      try {
        for (size_t i = 0; i < batches.size(); ++i) {
          const bool loss_ok = replay_forward_backward(batches[i], fn, batches.size(), t);
          own_bad = own_bad || !loss_ok;
          if ((!loss_ok || t.found()) && !reproduced) {
            reproduced = true;
            bad_batch = i;
            if (!collective_replay) break;
          }
        }
        tracer_pause pause(t);
        // This rank's own gradients: a collective's others may hold what another rank sent.
        const bool own_finite = host->backward_done();
        own_bad = own_bad || !own_finite;
        if (!reproduced)
          reproduced = collective_replay ? !own_finite : !sentinel.inspect_grads(scaler.inv_scale()).finite();
      } catch (const nonfinite_error& ex) {
        reproduced = true;
        add_note(e.note, "replay: " + message_of(ex));
      }
      reproduced = reproduced || t.found();
      e.findings = t.findings();
    } catch (const interrupted&) {
      throw;  // Ctrl-C: the user stops the run
    } catch (const std::exception& ex) {
      // E.g. a tracer already lives on this thread, or the step itself threw.
      failed = true;
      add_note(e.note, "replay failed: " + message_of(ex));
    }
    e.verdict = failed ? verdict::replay_failed : reproduced ? verdict::reproduced : verdict::not_reproduced;
    // (Not under a backward collective: one rank's bisection would run the model's collectives alone.)
    if (!failed && !reproduced && collective() == backward_collective::none) bisect_compiled(batches, fn, rng_before, e);
    host->zero_grad();
    detail::restore_generators(rng_after);
    return own_bad;
  }

  // A compiled model whose eager replay stayed finite: the host runs the
  // step again under each stage of the compiler; the stage that makes the
  // NaN/Inf again gives the verdict "compiled only" and the note.
  void bisect_compiled(const micro_batches& batches, const step_fn& fn, const detail::generator_states& rng_before,
                       step_event& e) {
    const auto step_finite = [&] {
      host->zero_grad();
      detail::restore_generators(rng_before);
      for (const auto& batch : batches) {
        const at::Tensor loss = loss_of(fn, batch);
        if (!sentinel.check_loss(loss)) return false;
        scaler.scale(share_of(loss, batches.size())).backward();
      }
      return sentinel.inspect_grads(scaler.inv_scale()).finite();
    };
    try {
      const std::string stage = host->bisect_compiled(step_finite);
      if (stage.empty()) return;
      e.verdict = verdict::compiled_only;
      add_note(e.note, stage);
    } catch (const interrupted&) {
      throw;
    } catch (const std::exception& ex) {
      add_note(e.note, "bisecting the compiled model failed: " + message_of(ex));
    }
  }

  // The loss `fn` gives for `batch`; refuses a step function that ran
  // backward itself (following torch's "retain_graph=True" advice would
  // then add every gradient twice).
  at::Tensor loss_of(const step_fn& fn, const std::vector<at::Tensor>& batch) {
    const auto before = gradient_marks();
    at::Tensor loss = fn(batch);
    TORCH_CHECK(gradient_marks() == before,
                "nanguard::guard: the step function ran backward() itself; return the loss without calling "
                "backward(): the guard runs backward (scaled, checked, clipped), and a second one would add every "
                "gradient twice");
    return loss;
  }

  // Each parameter's gradient and its version: a backward sets or adds to them.
  std::vector<std::pair<const void*, int64_t>> gradient_marks() const {
    std::vector<std::pair<const void*, int64_t>> marks;
    marks.reserve(sentinel.parameters().size());
    for (const at::Tensor& p : sentinel.parameters()) {
      const at::Tensor& g = p.grad();
      marks.emplace_back(g.unsafeGetTensorImpl(), g.defined() ? g._version() : 0);
    }
    return marks;
  }

  // Forgets the step begun last, uncounted, and its trace: cancel_step(), a
  // check() with no backward before it, a step whose function threw.
  void drop_started() {
    started.reset();
    live_run.reset();
    live.reset();
    --step;
  }

  // Whether a backward wrote a gradient since `before` (gradient_marks()):
  // one defined now that is another tensor, or the same at a later version.
  bool gradients_written_since(const std::vector<std::pair<const void*, int64_t>>& before) const {
    const auto now = gradient_marks();
    for (size_t i = 0; i < now.size(); ++i)
      if (sentinel.parameters()[i].grad().defined() && now[i] != before[i]) return true;
    return false;
  }

  // One micro-batch of the replay; returns whether its loss was finite.
  // Its backward runs on a bad loss too when the model's backward is a
  // collective (the other ranks' backward waits for it).
  bool replay_forward_backward(const std::vector<at::Tensor>& batch, const step_fn& fn, size_t n, tracer& t) {
    const at::Tensor loss = loss_of(fn, batch);
    bool loss_ok;
    {
      tracer_pause pause(t);
      loss_ok = sentinel.check_loss(loss);
    }
    if (loss_ok || collective() != backward_collective::none) scaler.scale(share_of(loss, n)).backward();
    else t.judge_by_outputs({loss});  // no backward to judge the chains: what reaches the loss does
    return loss_ok;
  }

  // Distributed: the consensus after the local sentinel pass. Fills the
  // event's rank, nonfinite_ranks, and on a step finite everywhere averages
  // the gradients and measures them again (the norm every rank clips by);
  // returns whether the step is finite on every rank. `finite`: whether
  // this rank's own loss and gradients were (under a backward collective,
  // before it: `report` is of the reduced gradients, which may hold what
  // another rank sent).
  bool agree(step_event& e, grad_report& report, bool finite) {
    distributed& d = *options.distributed();
    e.rank = d.rank();
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const double norm = report.finite() ? e.grad_norm : nan;  // NaN: every rank learns of it
    const consensus c = d.agree(!finite, finite ? norm : 0.0, finite ? e.loss : 0.0, step);
    e.nonfinite_ranks = c.nonfinite_ranks;
    if (!c.finite()) {
      if (e.reason.empty()) e.reason = "non-finite on rank(s) " + rank_list(c.nonfinite_ranks);
      return false;
    }
    if (!std::isfinite(c.grad_norm)) {
      // Every rank's loss was finite: the replay tells whose own gradients were not (name_origin).
      e.reason = "non-finite gradients after the " + std::string(to_string(collective()));
      return false;
    }
    e.loss = c.loss_sum / static_cast<double>(d.world_size());  // the spike windows see the same loss everywhere
    if (collective() == backward_collective::all_reduce) return true;  // averaged: the same norm on every rank
    if (collective() == backward_collective::reduce_scatter || !d.options().average_gradients()) {
      e.grad_norm = c.grad_norm;  // each rank holds a shard of the gradients
      return true;
    }
    d.average_gradients_(sentinel.parameters(), step);
    report = sentinel.inspect_grads(scaler.inv_scale());
    e.grad_norm = report.total_norm;
    e.top_norms = top_norms(sentinel.names(), report.norms, options.log_top_norms());
    if (!report.finite()) {
      // Identical on every rank: the sum overflowed in the all-reduce.
      e.reason = "non-finite averaged gradients";
      add_note(e.note,
               "the averaged gradients are not finite although every rank's were (overflow in the gradient "
               "all-reduce)");
      return false;
    }
    return true;
  }

  // Distributed: every bad rank broadcasts its replay's verdict and findings
  // (tagged with its rank); every rank's event gets all of them.
  void share_findings(step_event& e) {
    if (e.nonfinite_ranks.empty()) return;  // overflow in the all-reduce: nobody replayed
    distributed& d = *options.distributed();
    std::vector<finding> all;
    std::optional<nanguard::verdict> first_verdict;
    std::string note;
    for (int64_t r : e.nonfinite_ranks) {
      std::string payload;
      std::vector<finding> own;  // this rank's, whose input values (for the bundle) JSON does not carry
      if (r == d.rank()) {
        nlohmann::json j;
        j["verdict"] = to_string(e.verdict);
        j["note"] = e.note;
        j["findings"] = nlohmann::json::array();
        for (finding& f : e.findings) {
          f.rank = r;
          j["findings"].push_back(nlohmann::json::parse(to_json(f)));
        }
        own = e.findings;
        payload = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      }
      const nlohmann::json j = nlohmann::json::parse(d.broadcast(payload, r));
      if (!first_verdict) first_verdict = verdict_from_string(j.value("verdict", std::string()));
      const std::string n = j.value("note", std::string());
      if (!n.empty()) add_note(note, "rank " + std::to_string(r) + ": " + n);
      if (r == d.rank()) {
        all.insert(all.end(), own.begin(), own.end());
      } else {
        for (const auto& f : j.at("findings")) all.push_back(finding_from_json(f.dump()));
      }
    }
    e.findings = std::move(all);
    e.verdict = first_verdict.value_or(verdict::none);
    e.note = note;
  }

  // Under a backward collective, a bad step whose first consensus named no
  // rank: the second consensus, of what this rank's replay saw of its own
  // loss and gradients (`own_bad`), names the ranks the NaN/Inf came from;
  // none means the collective itself overflowed. Under trace_every_step the
  // first consensus carried every rank's own gradients already: none of them
  // was bad. Without either nobody knows.
  void name_origin(std::optional<bool> own_bad, step_event& e) {
    const std::string c = to_string(collective());
    if (!own_bad && !options.trace_every_step()) {
      add_note(e.note, fmt::format("every rank's loss was finite: the NaN/Inf came from a rank's own gradients or "
                                   "the model's {}; a replay (replay on, and guard.check's replay=) names the rank",
                                   c));
      return;
    }
    if (own_bad) e.nonfinite_ranks = options.distributed()->agree(*own_bad, 0.0, 0.0, step).nonfinite_ranks;
    if (e.nonfinite_ranks.empty())
      add_note(e.note, fmt::format("the gradients are not finite after the model's {} although every rank's own "
                                   "were in the replay (overflow in the {})", c, c));
    else
      e.reason = "non-finite gradients on rank(s) " + rank_list(e.nonfinite_ranks);
  }

  // Whether the NaN/Inf of bad step `e` came from this rank (single process: yes).
  bool is_origin(const step_event& e) const {
    return e.rank < 0 || std::find(e.nonfinite_ranks.begin(), e.nonfinite_ranks.end(), e.rank) != e.nonfinite_ranks.end();
  }

  // Under a backward collective, on a rank the NaN/Inf did not come from
  // but whose reduced gradients hold it: says where it came from.
  void note_received(const grad_report& report, step_event& e) const {
    if (report.finite() || e.nonfinite_ranks.empty()) return;
    add_note(e.note, fmt::format("this rank's own gradients were finite: the NaN/Inf was received from rank {} via "
                                 "{}", rank_list(e.nonfinite_ranks), to_string(collective())));
  }

  // Distributed: the gradient-consistency check when due. Returns whether
  // some rank's averaged gradients differ from the others' (the same answer
  // on every rank): a bad step, named in the note and warned about.
  bool inconsistent(step_event& e) {
    distributed& d = *options.distributed();
    const int64_t k = d.options().check_every();
    if (k <= 0 || step % k != 0 || !d.options().average_gradients() || collective() != backward_collective::none)
      return false;
    const std::vector<int64_t> differ = d.check_consistency(sentinel.parameters());
    if (differ.empty()) return false;
    e.reason = "gradient checksum differs on rank(s) " + rank_list(differ);
    const std::string note =
        "gradient checksum differs after averaging on rank(s) " + rank_list(differ) + " (silent data corruption?)";
    add_note(e.note, note);
    TORCH_WARN("nanguard::guard: step ", step, ": ", note);
    return true;
  }

  // Writes the repro bundle of a bad step; returns its directory.
  // The culprit's inputs are those the replay's tracer kept.
  std::string write_repro_bundle(const std::vector<at::Tensor>& batch, const detail::generator_states& rng_before,
                                 const step_event& e) {
    bundle b;
    b.step = e.step;
    b.lr = e.lr;
    b.scale = e.scale;
    b.loss = e.loss;
    b.policy = options.policy();
    b.verdict = e.verdict;
    b.batch = batch;
    b.rng_state = rng_before.cpu;
    b.cuda_rng_states = rng_before.cuda;
    if (!e.findings.empty()) b.finding = e.findings.front();
    b.note = e.note;  // a NaN only the compiled code makes: its stage, kernel and remedy
    if (options.bundle_parameters())
      b.parameters = host->named_parameters();
    if (b.finding && b.finding->role == role::producer) b.culprit_inputs = b.finding->input_values;
    b.tags = bundle_tags;
    return write_bundle(options.bundle_dir(), b);
  }

  // Copies `saved` into the host's parameters of the same names (a bundle's).
  void load_parameters(const named_tensors& saved) {
    const named_tensors own = host->named_parameters();
    const at::NoGradGuard no_grad;
    for (const auto& [name, value] : saved) {
      // Captured by name: a lambda capturing a structured binding is C++20 (clang 14 refuses it).
      const auto it =
          std::find_if(own.begin(), own.end(), [&wanted = name](const auto& p) { return p.first == wanted; });
      TORCH_CHECK(it != own.end(), "nanguard::guard::replay: the bundle's parameter '", name,
                  "' is not in the model; replay with the model the bundle was written from");
      TORCH_CHECK(it->second.sizes().equals(value.sizes()), "nanguard::guard::replay: the bundle's parameter '",
                  name, "' is ", value.sizes(), " but the model's is ", it->second.sizes(),
                  "; replay with the model the bundle was written from");
      it->second.detach().copy_(value);
    }
  }

  // ---- the stages of guard::step

  // Starts step `step + 1`: its schedule, LR and loss scale.
  step_event begin() {
    step_started = step_clock::now();
    user_s = 0;
    step_event e;
    e.step = ++step;
    if (schedule) apply_schedule();
    e.lr = first_lr();
    e.scale = scaler.get_scale();
    return e;
  }

  // Forward, the loss check and the (scaled) backward of each micro-batch,
  // then the sentinel's pass over the accumulated gradients; returns whether
  // all of it was finite here. A non-finite loss ends it at its micro-batch
  // (`bad_batch`).
  bool measure(const micro_batches& batches, const step_fn& fn, grad_report& report, size_t& bad_batch,
               step_event& e) {
    {
      user_time plain_work(user_s);
      host->zero_grad();
    }
    start_trace(batches);
    return measured(forward_backward(batches, fn, bad_batch, e), report, e);
  }

  // The end of a step's measurement, after its backward: the live trace's
  // findings, then the sentinel's pass when every loss was finite; returns
  // whether all of it was finite here (under a backward collective: this
  // rank's loss, and in a traced run its own gradients before the
  // collective, as the host tells; the consensus learns the rest).
  bool measured(bool losses_finite, grad_report& report, step_event& e) {
    finish_trace(e);
    const bool own_finite = host->backward_done();
    if (!losses_finite) {
      e.grad_norm = std::numeric_limits<double>::quiet_NaN();
      e.reason = "non-finite loss";
      return false;
    }
    const bool finite = inspect(report, e);
    const bool finite_here = collective() == backward_collective::none ? finite : own_finite;
    if (!finite_here) e.reason = "non-finite gradient";
    return finite_here;
  }

  // Forward, the loss check and the (scaled) backward of each micro-batch;
  // returns whether every loss was finite (else `bad_batch` is the first
  // that was not). The event's loss is their mean.
  // Under a backward collective every micro-batch runs backward, a bad one
  // too: the other ranks' backward waits for this one's.
  bool forward_backward(const micro_batches& batches, const step_fn& fn, size_t& bad_batch, step_event& e) {
    double loss_sum = 0;
    bool finite = true;
    for (size_t i = 0; i < batches.size(); ++i) {
      at::Tensor loss;
      {
        user_time plain_work(user_s);
        loss = loss_of(fn, batches[i]);
      }
      double value = 0;
      if (!sentinel.check_loss(loss, &value) && finite) {
        finite = false;
        bad_batch = i;
        e.loss = value;
        if (collective() == backward_collective::none) return false;
      }
      loss_sum += value;
      user_time plain_work(user_s);
      backward(scaler.scale(share_of(loss, batches.size())));
    }
    if (finite) e.loss = loss_sum / double(batches.size());
    return finite;
  }

  // A step's backward. Under a backward collective, when it fails because
  // another rank has exited, the error names that rank.
  void backward(const at::Tensor& loss) {
    try {
      loss.backward();
    } catch (const interrupted&) {
      throw;
    } catch (const std::exception& ex) {
      if (collective() == backward_collective::none || options.distributed()->exited_ranks().empty()) throw;
      options.distributed()->raise_failure(
          fmt::format("the model's {} in the backward of step {}", to_string(collective()), step), ex);
    }
  }

  // The sentinel's pass over the gradients; returns whether they are finite.
  bool inspect(grad_report& report, step_event& e) {
    report = sentinel.inspect_grads(scaler.inv_scale());
    e.grad_norm = report.total_norm;
    e.top_norms = top_norms(sentinel.names(), report.norms, options.log_top_norms());
    return report.finite();
  }

  // The rest of a measured step, the same for guard::step and guard::check:
  // the consensus (distributed), then take a finite step, or localize the
  // bad one, decide and act (abort throws). `bad_batch`: the micro-batch a
  // bundle keeps.
  void conclude(const micro_batches& batches, const step_fn& fn, const detail::generator_states& rng_before,
                grad_report& report, bool locally_finite, size_t bad_batch, bool step_optimizer, step_event& e) {
    const bool finite = options.distributed() ? agree(e, report, locally_finite) && !inconsistent(e)
                                              : locally_finite;
    bool runaway = false, quarantined = false;
    if (finite) {
      e.spikes = sentinel.observe(e.loss, e.grad_norm);
      ++steps_observed;
      runaway = running_away(e);
      if (!runaway) {
        take(e, step_optimizer);
        return;
      }
      not_taken(e);
    } else {
      quarantined = localize(batches, fn, rng_before, report, locally_finite, bad_batch, e);
    }
    act(decide(e, runaway, quarantined), batches[bad_batch], rng_before, e);
  }

  // Whether the snapshots are kept (the policies that roll back).
  bool rolls_back() const {
    return options.policy() == policy::rollback || options.policy() == policy::automatic;
  }

  // auto: whether the finite step `e` is the third in a row whose loss
  // spiked by spike_rollback_z and to 10 times the median of the steps
  // before (a converged loss has so small a spread that a rise within noise
  // scores a high z): the run diverges, and the guard rolls back before the
  // NaN/Inf comes (its reason says so).
  bool running_away(step_event& e) {
    if (options.policy() != policy::automatic || options.spike_rollback_z() <= 0) return false;
    const bool spiked = std::any_of(e.spikes.begin(), e.spikes.end(), [&](const spike& s) {
      return s.series == "loss" && s.z >= options.spike_rollback_z() &&
             s.value > 10 * detail::median({losses.begin(), losses.end()});
    });
    spiking = spiked ? spiking + 1 : 0;
    if (spiking < 3) return false;
    e.reason = fmt::format("loss diverging: a spike of z >= {:g} on 3 steps in a row (loss {:.6g})",
                           options.spike_rollback_z(), e.loss);
    return true;
  }

  // A finite step: unscale + clip in one write, the optimizer steps (unless
  // a framework steps it), a calm step may become the snapshot to roll
  // back to.
  void take(step_event& e, bool step_optimizer) {
    e.clip_coef = clip_coefficient(e.grad_norm, options.max_norm());
    sentinel.apply_factor_(scaler.inv_scale() * e.clip_coef);
    if (options.clip_value() > 0) clip_grad_value_(sentinel.parameters(), options.clip_value());
    {
      user_time plain_work(user_s);
      if (step_optimizer) host->optimizer_step();
    }
    scaler.update(false);
    bad_in_a_row = 0;
    count_step(false);
    remember(e);
    if (rolls_back()) snapshot_if_due(e);
    write(e);
  }

  // Takes the snapshot when one is due and the step is calm: no spike (auto:
  // judged against enough steps, after a rollback too). A run that is
  // already diverging but still finite is not worth returning to.
  void snapshot_if_due(const step_event& e) {
    const double seconds = seconds_since(step_started);
    step_s = step_s == 0 ? seconds : 0.9 * step_s + 0.1 * seconds;
    if (step - last_snapshot < options.snapshot_every()) return;
    if (snapshot_interval == 0) snapshot_interval = measured_interval();
    snapshot_pending = snapshot_pending || step - last_snapshot >= snapshot_interval;
    const bool judged = options.policy() != policy::automatic || steps_observed > options.spikes().min_samples();
    const bool calm = e.spikes.empty() && judged;
    if (snapshot_pending && calm) snapshot();
  }

  // Copies the state into the ring, timing it.
  void snapshot() {
    const step_clock::time_point start = step_clock::now();
    ring.take(step);
    snapshot_s = seconds_since(start);
    last_snapshot = step;
    snapshot_interval = 0;
    snapshot_pending = false;
  }

  // The steps from the last snapshot to the next: snapshot_every, or under
  // auto as many as keep the last one's cost within budget against the
  // steps' time, up to 10 x snapshot_every (the recent snapshots stay
  // recent). Distributed: rank 0's, so that every rank snapshots the same steps.
  int64_t measured_interval() {
    const bool budgeted = options.policy() == policy::automatic && snapshot_s >= snapshot_always_s;
    const double within_budget = budgeted ? std::ceil(snapshot_s / (snapshot_budget * std::max(step_s, 1e-9))) : 0;
    const double most = 10.0 * double(options.snapshot_every());
    int64_t interval = std::max<int64_t>(options.snapshot_every(), static_cast<int64_t>(std::min(within_budget, most)));
    if (options.distributed()) interval = std::stoll(options.distributed()->broadcast(std::to_string(interval), 0));
    return interval;
  }

  // max_bad_fraction's window: whether this step was bad.
  void count_step(bool bad) {
    recent_bad.push_back(bad);
    if (int64_t(recent_bad.size()) > max_bad_window) recent_bad.pop_front();
  }

  // A step the optimizer does not take: its gradients go, and it is counted bad.
  void not_taken(step_event& e) {
    host->zero_grad();
    e.skipped = true;
    ++skipped;
    ++bad_in_a_row;
    count_step(true);
  }

  // A bad step: which parameters, and the replay that names the op (where
  // the problem was seen; distributed, its finding reaches every rank).
  // Nothing is stepped. Returns whether its batch was quarantined (auto).
  bool localize(const micro_batches& batches, const step_fn& fn, const detail::generator_states& rng_before,
                const grad_report& report, bool locally_finite, size_t& bad_batch, step_event& e) {
    for (size_t i = 0; i < report.nonfinite_counts.size(); ++i)
      if (report.nonfinite_counts[i] > 0) e.nonfinite_params.push_back({sentinel.names()[i], report.nonfinite_counts[i]});
    // auto: a quarantined batch is not replayed: its first findings stand.
    const std::optional<uint64_t> batch_id = bad_batch_id(batches);
    bad_batch_record* before = batch_id ? &bad_batches[*batch_id] : nullptr;
    const bool quarantined = before && before->quarantined;
    // Under a backward collective the step is bad on every rank, and every
    // rank replays it (the model's collectives run again).
    const bool collective_step = collective() != backward_collective::none;
    std::optional<bool> own_bad;  // in the replay: this rank's own loss or gradients were not finite
    if (quarantined) {
      e.findings = before->findings;
      add_note(e.note, fmt::format("quarantined batch (bad at step {} first, {} times now): not replayed",
                                   before->first_step, before->times + 1));
    } else if (options.replay() && !options.trace_every_step() && fn && (collective_step || !locally_finite)) {
      own_bad = replay(batches, fn, rng_before, bad_batch, e);
    }
    if (collective_step && e.nonfinite_ranks.empty()) name_origin(own_bad, e);
    if ((options.replay() || options.trace_every_step()) && options.distributed()) share_findings(e);
    if (collective_step && !is_origin(e)) note_received(report, e);
    if (batches.size() > 1 && !locally_finite)
      add_note(e.note, fmt::format("micro-batch {} of {}", bad_batch, batches.size()));
    const diagnosis_context h = history(e, batches[bad_batch]);
    for (finding& f : e.findings) f.diagnosis = diagnose(f, h);
    if (before) remember_bad(*before, e);
    not_taken(e);
    return quarantined;
  }

  // auto in one process: the fingerprint of a bad step's batch (none when
  // the step has no batch; distributed, each rank's batch is its own, and
  // the ranks must decide alike).
  std::optional<uint64_t> bad_batch_id(const micro_batches& batches) const {
    if (options.policy() != policy::automatic || options.distributed()) return std::nullopt;
    return fingerprint(batches);
  }

  // Counts a bad step of the batch `b`; quarantines it the second time, or
  // the first when the data itself was bad. A divergence, an overflow or a
  // loss-scale overflow is the model's or the LR's: the batch is not blamed.
  void remember_bad(bad_batch_record& b, step_event& e) {
    const std::optional<nanguard::cause> c = first_cause(e);
    if (c == cause::divergence || c == cause::overflow || c == cause::precision_range || scale_overflow(e, c)) return;
    if (b.times++ == 0) {
      b.first_step = e.step;
      b.findings = e.findings;
    }
    if (!b.quarantined && (b.times >= 2 || c == cause::bad_data)) {
      b.quarantined = true;
      add_note(e.note, fmt::format("batch quarantined (bad at step {}{})", b.first_step,
                                   b.times >= 2 ? fmt::format(" and {}", e.step) : std::string()));
    }
  }

  // The policy for this bad step: abort when the run keeps going bad
  // (max_bad_steps, max_bad_fraction), a rollback when it is `runaway`
  // (running_away), else the options' (auto: by cause; `quarantined`: its
  // batch was).
  policy decide(step_event& e, bool runaway, bool quarantined) const {
    const std::string too_many = too_many_bad();
    if (!too_many.empty()) {
      add_note(e.note, too_many);
      return policy::abort;
    }
    if (runaway) return policy::rollback;
    return options.policy() == policy::automatic ? by_cause(e, quarantined) : options.policy();
  }

  // Why the run is stopped: max_bad_steps bad steps in a row, or more than
  // max_bad_fraction of the recent ones ("" : neither).
  std::string too_many_bad() const {
    if (options.max_bad_steps() > 0 && bad_in_a_row >= options.max_bad_steps())
      return fmt::format("max_bad_steps={}: {} bad step{} in a row", options.max_bad_steps(), bad_in_a_row,
                         bad_in_a_row == 1 ? "" : "s");
    const auto bad = std::count(recent_bad.begin(), recent_bad.end(), true);
    const auto n = static_cast<int64_t>(recent_bad.size());
    if (n >= max_bad_min_steps && double(bad) > options.max_bad_fraction() * double(n))
      return fmt::format("max_bad_fraction={:g}: {} of the last {} steps were bad", options.max_bad_fraction(), bad, n);
    return "";
  }

  // The cause of the first finding of `e` (none without one).
  static std::optional<nanguard::cause> first_cause(const step_event& e) {
    return e.findings.empty() ? std::nullopt : std::optional(e.findings.front().diagnosis.cause);
  }

  // Whether the loss scale made bad step `e` (first cause `c`): a finite
  // loss whose scaled gradients overflowed, with no cause or a range one.
  bool scale_overflow(const step_event& e, std::optional<nanguard::cause> c) const {
    return scaler.enabled() && std::isfinite(e.loss) &&
           (!c || c == cause::precision_range || c == cause::overflow);
  }

  // auto: the action for the diagnosed cause (docs/guard.md's decision table).
  policy by_cause(const step_event& e, bool quarantined) const {
    const std::optional<nanguard::cause> c = first_cause(e);
    if (quarantined || c == cause::bad_data) return policy::skip;  // the data's fault: the model is fine
    if (scale_overflow(e, c)) return policy::backoff;
    if (c == cause::divergence || c == cause::overflow) return policy::rollback;
    if (c == cause::precision_range) return scaler.enabled() ? policy::backoff : policy::skip;
    // Skipping does not help when the run itself keeps going bad.
    return bad_in_a_row >= 3 ? policy::rollback : policy::skip;
  }

  // Applies `p` and records the event. The loss scaler backs off on every
  // non-finite step (GradScaler semantics). Abort writes the bundle and throws.
  void act(policy p, const std::vector<at::Tensor>& batch, const detail::generator_states& rng_before,
           step_event& e) {
    e.action = action_of(p);
    switch (p) {
      case policy::abort: abort_step(batch, rng_before, e);
      case policy::automatic:  // decide() has chosen
      case policy::skip: break;
      case policy::backoff:
        if (!scaler.enabled()) add_note(e.note, "loss scaling is disabled: the step was skipped");
        break;
      case policy::rollback: roll_back(e); break;
    }
    back_off(e);
    e.remedy = applied_remedy(e, first_lr(), scaler.get_scale());
    write(e);
  }

  void back_off(step_event& e) {
    try {
      scaler.update(true);
    } catch (const std::exception& ex) {
      add_note(e.note, message_of(ex));
      write(e);
      throw;
    }
  }

  // Restores the last good snapshot and lowers the LR.
  void roll_back(step_event& e) {
    add_note(e.note, moved_most(ring.diff()));  // the diverged layers
    // Diverging again from the snapshot just restored (no newer one since):
    // it was taken on the way up; go one further back when there is one.
    if (ring.newest_step() == restored_step && ring.size() > 1) ring.drop_newest();
    e.rollback_to = restored_step = ring.restore();
    lr_factor *= options.rollback_lr_factor();
    if (!schedule) scale_lrs(*host, options.rollback_lr_factor());
    else apply_schedule();
    ++rollbacks;
    sentinel.reset_spikes();  // the windows hold the divergence
    spiking = steps_observed = 0;
    snapshot_pending = false;
  }

  // Writes the repro bundle (distributed: the first rank that saw it, with
  // its batch), records the event and throws nonfinite_error.
  [[noreturn]] void abort_step(const std::vector<at::Tensor>& batch, const detail::generator_states& rng_before,
                               step_event& e) {
    e.remedy = "stopped training";
    const int64_t writer = e.nonfinite_ranks.empty() ? 0 : e.nonfinite_ranks.front();
    if (options.bundle_dir().empty()) {
      // no bundle asked for
    } else if (!options.distributed() || e.rank == writer) {
      try {
        e.bundle = write_repro_bundle(batch, rng_before, e);
        e.remedy += "; repro bundle in " + e.bundle;
      } catch (const std::exception& ex) {
        // The run still stops on its NaN/Inf: that is the error to raise.
        const std::string why = message_of(ex);
        add_note(e.note, "no repro bundle: " + why);
        TORCH_WARN("nanguard::guard: step ", e.step, ": no repro bundle: ", why);
      }
    } else {
      add_note(e.note, "the repro bundle is written by rank " + std::to_string(writer));
    }
    write(e);
    throw nonfinite_error(thrown_finding(e, batch));
  }

  // What abort throws: the first finding, or when the replay named no op
  // one naming the first bad parameter, the loss, or (all finite: the
  // gradient checksums differed) the averaged gradients.
  finding thrown_finding(const step_event& e, const std::vector<at::Tensor>& batch) const {
    if (!e.findings.empty()) return e.findings.front();
    finding f;
    f.step = step;
    f.role = role::input;
    if (!e.nonfinite_params.empty()) {
      f.op = "backward";
      f.culprit = e.nonfinite_params.front().name;
      f.value = std::numeric_limits<double>::quiet_NaN();
    } else {
      f.op = std::isfinite(e.loss) ? "gradient all-reduce" : "loss";
      f.culprit = std::isfinite(e.loss) ? "averaged gradients" : "loss";
      f.value = e.loss;
    }
    if (options.distributed()) f.rank = e.nonfinite_ranks.empty() ? e.rank : e.nonfinite_ranks.front();
    f.diagnosis = diagnose(f, history(e, batch));
    return f;
  }
};

guard::guard(torch::nn::Module& model, torch::optim::Optimizer& optimizer, guard_options options)
    : guard(std::make_shared<module_host>(model, optimizer), std::move(options)) {}

guard::guard(std::shared_ptr<training_host> host, guard_options options) {
  TORCH_CHECK(host, "nanguard::guard: the training host is null");
  const auto& o = options;
  TORCH_CHECK(o.max_norm() >= 0 && std::isfinite(o.max_norm()),
              "nanguard::guard_options: max_norm must be finite and >= 0 but is ", o.max_norm(),
              "; 0 disables clipping, 1.0 is common");
  TORCH_CHECK(o.clip_value() >= 0 && std::isfinite(o.clip_value()),
              "nanguard::guard_options: clip_value must be finite and >= 0 but is ", o.clip_value(),
              "; 0 disables value clipping");
  TORCH_CHECK(o.snapshot_every() >= 1, "nanguard::guard_options: snapshot_every must be >= 1 but is ",
              o.snapshot_every(), "; e.g. 100");
  TORCH_CHECK(o.snapshot_keep() >= 1, "nanguard::guard_options: snapshot_keep must be >= 1 but is ",
              o.snapshot_keep(), "; e.g. 2");
  TORCH_CHECK(o.rollback_lr_factor() > 0 && o.rollback_lr_factor() <= 1,
              "nanguard::guard_options: rollback_lr_factor must be in (0, 1] but is ", o.rollback_lr_factor(),
              "; e.g. 0.5 halves the LR on every rollback");
  TORCH_CHECK(o.max_bad_steps() >= 0, "nanguard::guard_options: max_bad_steps must be >= 0 but is ",
              o.max_bad_steps(), "; 0 never aborts on its own");
  TORCH_CHECK(o.max_bad_fraction() > 0 && o.max_bad_fraction() <= 1,
              "nanguard::guard_options: max_bad_fraction must be in (0, 1] but is ", o.max_bad_fraction(),
              "; 1 never aborts on its own, 0.5 aborts when most recent steps are bad");
  TORCH_CHECK(o.log_top_norms() >= 0, "nanguard::guard_options: log_top_norms must be >= 0 but is ",
              o.log_top_norms(), "; 0 lists no per-parameter norm, 5 is the default");
  TORCH_CHECK(o.spike_rollback_z() >= 0 && std::isfinite(o.spike_rollback_z()),
              "nanguard::guard_options: spike_rollback_z must be finite and >= 0 but is ", o.spike_rollback_z(),
              "; 0 turns the spike rollback off, 100 is the default");
  TORCH_CHECK(!host->lrs().empty(),
              "nanguard::guard: the optimizer has no param groups; make it with model->parameters()");
  impl_ = std::make_unique<impl>(std::move(host), std::move(options));
  impl& s = *impl_;
  if (s.options.schedule()) s.schedule.emplace(*s.options.schedule());
  if (!s.options.event_log().empty())
    s.log = std::make_unique<event_log>(s.options.event_log(), s.options.truncate_event_log());
  if (s.rolls_back()) s.snapshot();  // the snapshot of step 0
  if (s.options.distributed()) {
    // A collective: every rank builds its guard, over the same model (ranks
    // that each hold a shard of it have as many parameters, not as many elements).
    distributed& d = *s.options.distributed();
    d.check_same_parameters(s.sentinel.parameters(), d.options().backward() != backward_collective::reduce_scatter &&
                                                         d.options().average_gradients());
  }
}

guard::~guard() {
  const impl& s = *impl_;
  if (s.last && s.narrator.summary().not_taken > 0 && s.speaks(*s.last))
    say(s.narrator.summary_line());
}

namespace {

// Marks a step of the guard under way: a step function that calls the
// guard again would interleave two steps (their gradients, RNG and events).
class one_step_at_a_time {
 public:
  one_step_at_a_time(bool& running, const char* call) : running_(running) {
    TORCH_CHECK(!running_, "nanguard::guard::", call, ": called from inside the step the guard is running (its step "
                "function or replay); call the guard from the training loop, one step at a time");
    running_ = true;
  }
  ~one_step_at_a_time() { running_ = false; }
  one_step_at_a_time(const one_step_at_a_time&) = delete;
  one_step_at_a_time& operator=(const one_step_at_a_time&) = delete;

 private:
  bool& running_;
};

}  // namespace

step_event guard::step(const std::vector<at::Tensor>& batch, const step_fn& fn) {
  return step_accumulated({batch}, fn);
}

// One step, in stages: begin, measure, then conclude (agree, take it or
// localize, decide and act); every stage that ends the step records its event.
step_event guard::step_accumulated(const micro_batches& batches, const step_fn& fn) {
  TORCH_CHECK(!batches.empty(), "nanguard::guard::step_accumulated: no micro-batches; pass at least one");
  impl& s = *impl_;
  const one_step_at_a_time running(s.running, "step");
  // A rollback that keeps the batch (rollback_skip_batch false) runs it once more.
  for (bool again = false;; again = true) {
    step_event e = s.begin();
    const detail::generator_states rng_before = detail::capture_generators();
    grad_report report;
    size_t bad_batch = 0;  // the micro-batch a bundle keeps
    bool locally_finite = false;
    try {
      locally_finite = s.measure(batches, fn, report, bad_batch, e);
    } catch (...) {
      s.drop_started();  // the caller's error: no step was taken, and the next one takes this number
      throw;
    }
    s.conclude(batches, fn, rng_before, report, locally_finite, bad_batch, /*step_optimizer=*/true, e);
    if (e.action != action::rollback || s.options.rollback_skip_batch() || again) return e;
  }
}

void guard::begin_step() {
  impl& s = *impl_;
  const one_step_at_a_time running(s.running, "begin_step");
  s.started = s.begin();
  s.started_rng = detail::capture_generators();
  s.started_gradients = s.gradient_marks();
  s.start_trace({});
  s.begun = step_clock::now();
}

void guard::cancel_step() {
  impl& s = *impl_;
  const one_step_at_a_time running(s.running, "cancel_step");
  TORCH_CHECK(s.started, "nanguard::guard::cancel_step: no step was begun; call begin_step() first");
  s.drop_started();
}

// The stages of step_accumulated after the framework's forward and backward.
step_event guard::check(const at::Tensor& loss, const step_fn& replay, const std::vector<at::Tensor>& batch) {
  impl& s = *impl_;
  const one_step_at_a_time running(s.running, "check");
  TORCH_CHECK(s.started, "nanguard::guard::check: no step was begun; call begin_step() before the step's "
              "first forward");
  s.user_s += seconds_since(s.begun);  // the framework's forward and backward: not the guard's time
  step_event e = std::move(*s.started);
  grad_report report;
  const bool loss_finite = s.sentinel.check_loss(loss, &e.loss);
  const bool locally_finite = s.measured(loss_finite, report, e);  // the host's gradients, as backward left them
  if (loss_finite && !s.gradients_written_since(s.started_gradients)) {
    s.drop_started();  // not counted: begin it again
    TORCH_CHECK(false, "nanguard::guard::check: no backward wrote a gradient since begin_step(); call "
                "loss.backward() before check(loss): the guard checks the gradients it made (a framework that "
                "skips the step calls cancel_step() instead)");
  }
  s.started.reset();
  s.conclude({batch}, replay, s.started_rng, report, locally_finite, /*bad_batch=*/0, /*step_optimizer=*/false, e);
  return e;
}

step_event guard::replay(const bundle& b, const step_fn& fn) {
  impl& s = *impl_;
  s.load_parameters(b.parameters);
  step_event e;
  e.step = b.step;
  e.loss = b.loss;
  e.lr = s.first_lr();
  e.scale = s.scaler.get_scale();
  detail::generator_states rng = detail::capture_generators();
  if (b.rng_state.defined() && b.rng_state.numel() > 0) rng.cpu = b.rng_state;
  // The bundle's CUDA generators for the devices this machine has (a CPU
  // run on a GPU machine bundles them too; replayed on a CPU, none is used).
  for (size_t i = 0; i < rng.cuda.size() && i < b.cuda_rng_states.size(); ++i) rng.cuda[i] = b.cuda_rng_states[i];
  size_t bad_batch = 0;
  s.replay({b.batch}, fn, rng, bad_batch, e);
  e.skipped = true;  // nothing was stepped
  return e;
}

void guard::set_bundle_tags(bundle_tag_list tags) { impl_->bundle_tags = std::move(tags); }

void guard::set_batch_names(std::vector<std::string> names) { impl_->batch_names = std::move(names); }

const step_event& guard::last_event() const {
  TORCH_CHECK(impl_->last, "nanguard::guard::last_event: no step has ended yet");
  return *impl_->last;
}

int64_t guard::steps() const { return impl_->step; }
int64_t guard::skipped() const { return impl_->skipped; }
int64_t guard::rollbacks() const { return impl_->rollbacks; }
double guard::lr_factor() const { return impl_->lr_factor; }
loss_scaler& guard::scaler() { return impl_->scaler; }
nanguard::sentinel& guard::sentinel() { return impl_->sentinel; }
snapshot_ring& guard::snapshots() { return impl_->ring; }
const guard_options& guard::options() const { return impl_->options; }
const run_narrator& guard::narrator() const { return impl_->narrator; }

}  // namespace nanguard
