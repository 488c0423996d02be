#include "nanguard/guard.h"

#include "nanguard/bundle.h"
#include "nanguard/census.h"
#include "nanguard/clip.h"
#include "nanguard/distributed.h"

#include "detail/generator_states.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/record_function.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>
#include <numeric>

namespace nanguard {

namespace {

using step_clock = std::chrono::steady_clock;

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

}  // namespace

const char* to_string(policy p) {
  switch (p) {
    case policy::skip: return "skip";
    case policy::backoff: return "backoff";
    case policy::rollback: return "rollback";
    case policy::abort: return "abort";
  }
  return "?";
}

namespace detail {
namespace {

// State of capture_producer_inputs; RecordFunction callbacks are plain
// function pointers, so it lives in a thread-local.
struct capture_state {
  std::string op;
  bool done = false;
  std::vector<at::Tensor> inputs;
};
thread_local capture_state* t_capture = nullptr;

bool ivalue_nonfinite(const c10::IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    return t.defined() && t.is_floating_point() && detail::has_nonfinite_on_this_thread(t);
  }
  if (v.isTensorList())
    for (const at::Tensor& t : v.toTensorVector())
      if (t.defined() && t.is_floating_point() && detail::has_nonfinite_on_this_thread(t)) return true;
  return false;
}

std::unique_ptr<at::ObserverContext> capture_start(const at::RecordFunction& fn) {
  capture_state* s = t_capture;
  if (!s || s->done || s->op != fn.name()) return nullptr;
  at::RecordFunctionGuard no_recursion(false);
  // Inputs are cloned at the start: in-place ops overwrite them.
  for (const auto& v : fn.inputs())
    if (ivalue_nonfinite(v)) return nullptr;
  s->inputs.clear();
  for (const auto& v : fn.inputs())
    if (v.isTensor() && v.toTensor().defined()) s->inputs.push_back(v.toTensor().detach().clone());
  return nullptr;
}

void capture_end(const at::RecordFunction& fn, at::ObserverContext*) {
  capture_state* s = t_capture;
  if (!s || s->done || s->op != fn.name() || s->inputs.empty()) return;
  at::RecordFunctionGuard no_recursion(false);
  for (const auto& v : fn.outputs())
    if (ivalue_nonfinite(v)) {
      s->done = true;
      return;
    }
  s->inputs.clear();
}

}  // namespace

std::vector<at::Tensor> capture_producer_inputs(const std::string& op, const std::function<void()>& fn) {
  capture_state state;
  state.op = op;
  capture_state* previous = t_capture;
  t_capture = &state;
  const auto handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback(capture_start, capture_end).needsInputs(true).needsOutputs(true)
          .scopes({at::RecordScope::FUNCTION}));
  try {
    fn();
  } catch (...) {
    at::removeCallback(handle);
    t_capture = previous;
    throw;
  }
  at::removeCallback(handle);
  t_capture = previous;
  return state.done ? state.inputs : std::vector<at::Tensor>{};
}

}  // namespace detail

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
  impl(torch::nn::Module& m, torch::optim::Optimizer& o, guard_options opts)
      : model(m), optimizer(o), options(std::move(opts)),
        scaler(options.scaler()),
        sentinel(m.named_parameters().pairs(), options.spikes()),
        ring(m, o, options.snapshot_keep()) {}

  torch::nn::Module& model;
  torch::optim::Optimizer& optimizer;
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
  bool retrying = false;
  step_clock::time_point step_started;  // of the step being run
  double user_s = 0;                    // its seconds of plain-loop work (see user_time)
  bool snapshot_pending = false;
  int64_t restored_step = -1;  // the snapshot the last rollback restored

  // Stamps the guard's own time so far on `e` and logs it.
  void write(step_event& e) {
    e.guard_ms = (seconds_since(step_started) - user_s) * 1e3;
    if (log) log->write(e);
  }

  // Runs the step again from the same RNG state, under the tracer; fills the
  // event's findings and verdict. Leaves gradients zeroed and the RNG where
  // the original step left it.
  void replay(const std::vector<at::Tensor>& batch, const step_fn& fn, const detail::generator_states& rng_before,
              step_event& e) {
    const detail::generator_states rng_after = detail::capture_generators();
    optimizer.zero_grad();
    detail::restore_generators(rng_before);
    bool reproduced = false, failed = false;
    try {
      tracer t(options.tracer());
      t.name_parameters(model);
      for (size_t i = 0; i < batch.size(); ++i)
        if (batch[i].defined()) t.name_tensor(batch[i], "batch[" + std::to_string(i) + "]");
      t.set_step(step);
      try {
        const at::Tensor loss = fn(batch);
        bool loss_ok;
        {
          tracer_pause pause(t);
          loss_ok = sentinel.check_loss(loss);
        }
        if (!loss_ok) {
          reproduced = true;
        } else {
          scaler.scale(loss).backward();
          tracer_pause pause(t);
          reproduced = !sentinel.inspect_grads(scaler.inv_scale()).finite();
        }
      } catch (const nonfinite_error& ex) {
        reproduced = true;
        e.note = std::string("replay: ") + ex.what();
      }
      reproduced = reproduced || t.found();
      e.findings = t.findings();
    } catch (const std::exception& ex) {
      // E.g. a tracer already lives on this thread, or the step itself threw.
      failed = true;
      e.note = std::string("replay failed: ") + ex.what();
    }
    e.verdict = failed ? "replay failed" : reproduced ? "reproduced" : "not reproduced";
    optimizer.zero_grad();
    detail::restore_generators(rng_after);
  }

  // Distributed: the consensus after the local sentinel pass. Fills the
  // event's rank, nonfinite_ranks, and on a step finite everywhere averages
  // the gradients and measures them again (the norm every rank clips by);
  // returns whether the step is finite on every rank.
  bool agree(step_event& e, grad_report& report, bool finite) {
    distributed& d = *options.distributed();
    e.rank = d.rank();
    const consensus c = d.agree(!finite, finite ? e.grad_norm * e.grad_norm : 0.0, finite ? e.loss : 0.0);
    e.nonfinite_ranks = c.nonfinite_ranks;
    if (!c.finite()) return false;
    e.loss = c.loss_sum / static_cast<double>(d.world_size());  // the spike windows see the same loss everywhere
    if (!d.options().average_gradients()) {
      e.grad_norm = std::sqrt(c.sumsq);  // each rank holds a shard of the gradients
      return true;
    }
    d.average_gradients_(sentinel.parameters(), step);
    report = sentinel.inspect_grads(scaler.inv_scale());
    e.grad_norm = report.total_norm;
    e.top_norms = top_norms(sentinel.names(), report.norms, options.log_top_norms());
    if (!report.finite()) {
      // Identical on every rank: the sum overflowed in the all-reduce.
      e.note = "the averaged gradients are not finite although every rank's were (overflow in the gradient "
               "all-reduce)";
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
    std::string verdict, note;
    for (int64_t r : e.nonfinite_ranks) {
      std::string payload;
      if (r == d.rank()) {
        nlohmann::json j;
        j["verdict"] = e.verdict;
        j["note"] = e.note;
        j["findings"] = nlohmann::json::array();
        for (finding& f : e.findings) {
          f.rank = r;
          j["findings"].push_back(nlohmann::json::parse(to_json(f)));
        }
        payload = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      }
      const nlohmann::json j = nlohmann::json::parse(d.broadcast(payload, r));
      if (verdict.empty()) verdict = j.value("verdict", std::string());
      const std::string n = j.value("note", std::string());
      if (!n.empty()) note += (note.empty() ? "" : "; ") + ("rank " + std::to_string(r) + ": " + n);
      for (const auto& f : j.at("findings")) all.push_back(finding_from_json(f.dump()));
    }
    e.findings = std::move(all);
    e.verdict = verdict;
    e.note = note;
  }

  // Distributed: the gradient-consistency check when due; a rank whose
  // averaged gradients differ from the others' is named and the step skipped
  // on every rank. Returns true when the step was skipped.
  bool inconsistent(step_event& e) {
    distributed& d = *options.distributed();
    const int64_t k = d.options().check_every();
    if (k <= 0 || step % k != 0 || !d.options().average_gradients()) return false;
    const std::vector<int64_t> differ = d.check_consistency(sentinel.parameters());
    if (differ.empty()) return false;
    std::string ranks;
    for (int64_t r : differ) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    e.note = "gradient checksum differs after averaging on rank(s) " + ranks +
             " (silent data corruption?): the step was skipped on every rank";
    TORCH_WARN("nanguard::guard: step ", step, ": ", e.note);
    optimizer.zero_grad();
    e.skipped = true;
    e.action = "skip";
    ++skipped;
    write(e);
    return true;
  }

  // Writes the repro bundle of a bad step; returns its directory.
  std::string write_repro_bundle(const std::vector<at::Tensor>& batch, const step_fn& fn,
                                 const detail::generator_states& rng_before, const step_event& e) {
    bundle b;
    b.step = e.step;
    b.lr = e.lr;
    b.scale = e.scale;
    b.loss = e.loss;
    b.policy = to_string(options.policy());
    b.verdict = e.verdict;
    b.batch = batch;
    b.rng_state = rng_before.cpu;
    b.cuda_rng_states = rng_before.cuda;
    if (!e.findings.empty()) b.finding = e.findings.front();
    if (options.bundle_parameters())
      for (const auto& item : model.named_parameters()) b.parameters.emplace_back(item.key(), item.value());
    if (b.finding && b.finding->role == role::producer && !b.finding->op.empty()) {
      // One more replay, watching only the producer's op, to keep its inputs.
      const detail::generator_states rng_after = detail::capture_generators();
      detail::restore_generators(rng_before);
      try {
        b.culprit_inputs = detail::capture_producer_inputs(b.finding->op, [&] {
          const at::Tensor loss = fn(batch);
          if (std::isfinite(loss.item<double>())) scaler.scale(loss).backward();
        });
      } catch (const std::exception&) {
        // The bundle is still useful without the culprit's inputs.
      }
      optimizer.zero_grad();
      detail::restore_generators(rng_after);
    }
    return write_bundle(options.bundle_dir(), b);
  }
};

guard::guard(torch::nn::Module& model, torch::optim::Optimizer& optimizer, guard_options options)
    : impl_(std::make_unique<impl>(model, optimizer, std::move(options))) {
  const auto& o = impl_->options;
  TORCH_CHECK(o.max_norm() >= 0 && std::isfinite(o.max_norm()),
              "nanguard::guard_options: max_norm must be finite and >= 0 but is ", o.max_norm(),
              "; 0 disables clipping, 1.0 is common");
  TORCH_CHECK(o.clip_value() >= 0 && std::isfinite(o.clip_value()),
              "nanguard::guard_options: clip_value must be finite and >= 0 but is ", o.clip_value(),
              "; 0 disables value clipping");
  TORCH_CHECK(o.snapshot_every() >= 1, "nanguard::guard_options: snapshot_every must be >= 1 but is ",
              o.snapshot_every(), "; e.g. 100");
  TORCH_CHECK(o.rollback_lr_factor() > 0 && o.rollback_lr_factor() <= 1,
              "nanguard::guard_options: rollback_lr_factor must be in (0, 1] but is ", o.rollback_lr_factor(),
              "; e.g. 0.5 halves the LR on every rollback");
  TORCH_CHECK(o.max_bad_steps() >= 0, "nanguard::guard_options: max_bad_steps must be >= 0 but is ",
              o.max_bad_steps(), "; 0 never aborts on its own");
  TORCH_CHECK(!optimizer.param_groups().empty(),
              "nanguard::guard: the optimizer has no param groups; make it with model->parameters()");
  if (o.schedule()) impl_->schedule.emplace(*o.schedule());
  if (!o.event_log().empty()) impl_->log = std::make_unique<event_log>(o.event_log(), o.truncate_event_log());
  if (o.policy() == policy::rollback) impl_->ring.take(0);
}

guard::~guard() = default;

step_event guard::step(const std::vector<at::Tensor>& batch, const step_fn& fn) {
  impl& s = *impl_;
  s.step_started = step_clock::now();
  s.user_s = 0;
  const guard_options& o = s.options;
  step_event e;
  e.step = ++s.step;
  if (s.schedule) s.schedule->apply(s.optimizer, s.step - 1, s.lr_factor);
  e.lr = get_lr(s.optimizer);
  e.scale = s.scaler.get_scale();
  const detail::generator_states rng_before = detail::capture_generators();

  grad_report report;
  bool finite;
  {
    at::Tensor loss;
    {
      user_time plain_work(s.user_s);
      s.optimizer.zero_grad();
      loss = fn(batch);
    }
    finite = s.sentinel.check_loss(loss, &e.loss);
    if (finite) {
      {
        user_time plain_work(s.user_s);
        s.scaler.scale(loss).backward();
      }
      report = s.sentinel.inspect_grads(s.scaler.inv_scale());
      e.grad_norm = report.total_norm;
      e.top_norms = top_norms(s.sentinel.names(), report.norms, o.log_top_norms());
      finite = report.finite();
    } else {
      e.grad_norm = std::numeric_limits<double>::quiet_NaN();
    }
  }
  const bool locally_finite = finite;
  if (o.distributed()) finite = s.agree(e, report, finite);

  if (finite) {
    if (o.distributed() && s.inconsistent(e)) return e;
    e.spikes = s.sentinel.observe(e.loss, e.grad_norm);
    e.clip_coef = clip_coefficient(e.grad_norm, o.max_norm());
    s.sentinel.apply_factor_(s.scaler.inv_scale() * e.clip_coef);  // unscale + clip: one write
    if (o.clip_value() > 0) clip_grad_value_(s.sentinel.parameters(), o.clip_value());
    {
      user_time plain_work(s.user_s);
      s.optimizer.step();
    }
    s.scaler.update(false);
    s.bad_in_a_row = 0;
    if (o.policy() == policy::rollback) {
      // Only calm steps make a "last good" snapshot: a run that is already
      // diverging (spiking) but still finite is not worth returning to.
      s.snapshot_pending = s.snapshot_pending || s.step % o.snapshot_every() == 0;
      if (s.snapshot_pending && e.spikes.empty()) {
        s.ring.take(s.step);
        s.snapshot_pending = false;
      }
    }
    s.write(e);
    return e;
  }

  // Not finite: nothing is stepped. Name the op first, then act.
  for (size_t i = 0; i < report.nonfinite_counts.size(); ++i)
    if (report.nonfinite_counts[i] > 0)
      e.nonfinite_params.push_back({s.sentinel.names()[i], report.nonfinite_counts[i]});
  if (o.distributed()) {
    // The replay runs where the problem was seen; its finding reaches every rank.
    if (o.replay() && !locally_finite) s.replay(batch, fn, rng_before, e);
    if (o.replay()) s.share_findings(e);
  } else if (o.replay()) {
    s.replay(batch, fn, rng_before, e);
  }
  s.optimizer.zero_grad();
  e.skipped = true;
  ++s.skipped;
  ++s.bad_in_a_row;

  policy p = o.policy();
  if (o.max_bad_steps() > 0 && s.bad_in_a_row >= o.max_bad_steps()) {
    p = policy::abort;
    e.note = "max_bad_steps=" + std::to_string(o.max_bad_steps()) + " non-finite steps in a row";
  }

  if (p == policy::abort) {
    e.action = "abort";
    // Distributed: the first rank that saw it writes the bundle (its batch).
    const int64_t writer = e.nonfinite_ranks.empty() ? 0 : e.nonfinite_ranks.front();
    if (!o.distributed() || e.rank == writer)
      e.bundle = s.write_repro_bundle(batch, fn, rng_before, e);
    else
      e.note += std::string(e.note.empty() ? "" : "; ") + "the repro bundle is written by rank " +
                std::to_string(writer);
    s.write(e);
    finding f;
    if (!e.findings.empty()) {
      f = e.findings.front();
    } else {
      f.step = s.step;
      f.op = e.nonfinite_params.empty() ? "loss" : "backward";
      f.role = role::input;
      f.culprit = e.nonfinite_params.empty() ? "loss" : e.nonfinite_params.front().name;
      f.value = e.nonfinite_params.empty() ? e.loss : std::numeric_limits<double>::quiet_NaN();
      if (o.distributed()) f.rank = e.nonfinite_ranks.empty() ? e.rank : e.nonfinite_ranks.front();
    }
    throw nonfinite_error(f);
  }

  // The loss scaler backs off on every non-finite step (GradScaler semantics).
  const auto backoff = [&] {
    try {
      s.scaler.update(true);
    } catch (const std::exception& ex) {
      e.note = ex.what();
      s.write(e);
      throw;
    }
  };
  switch (p) {
    case policy::skip:
      e.action = "skip";
      backoff();
      break;
    case policy::backoff:
      e.action = "backoff";
      if (!s.scaler.enabled()) e.note = "loss scaling is disabled: the step was skipped";
      backoff();
      break;
    case policy::rollback: {
      e.action = "rollback";
      {
        // Which layers moved most since the snapshot: the diverged ones.
        const auto changes = s.ring.diff();
        std::string moved = "moved most since the snapshot:";
        for (size_t i = 0; i < changes.size() && i < 3; ++i)
          moved += " " + changes[i].name + " (x" + c10::str(changes[i].relative) + ")";
        e.note = e.note.empty() ? moved : e.note + "; " + moved;
      }
      // Diverging again from the snapshot just restored (no newer one since):
      // it was taken on the way up; go one further back when there is one.
      if (s.ring.newest_step() == s.restored_step && s.ring.size() > 1) s.ring.drop_newest();
      e.rollback_to = s.restored_step = s.ring.restore();
      s.lr_factor *= o.rollback_lr_factor();
      if (!s.schedule) scale_lr(s.optimizer, o.rollback_lr_factor());
      else s.schedule->apply(s.optimizer, s.step - 1, s.lr_factor);
      ++s.rollbacks;
      s.sentinel.reset_spikes();  // the windows hold the divergence
      s.snapshot_pending = false;
      backoff();
      break;
    }
    case policy::abort: break;  // handled above
  }
  s.write(e);
  if (p == policy::rollback && !o.rollback_skip_batch() && !s.retrying) {
    s.retrying = true;
    struct reset {
      bool& flag;
      ~reset() { flag = false; }
    } r{s.retrying};
    return step(batch, fn);
  }
  return e;
}

int64_t guard::steps() const { return impl_->step; }
int64_t guard::skipped() const { return impl_->skipped; }
int64_t guard::rollbacks() const { return impl_->rollbacks; }
double guard::lr_factor() const { return impl_->lr_factor; }
loss_scaler& guard::scaler() { return impl_->scaler; }
nanguard::sentinel& guard::sentinel() { return impl_->sentinel; }
snapshot_ring& guard::snapshots() { return impl_->ring; }
const guard_options& guard::options() const { return impl_->options; }

}  // namespace nanguard
