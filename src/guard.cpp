#include "nanguard/guard.h"

#include "nanguard/bundle.h"
#include "nanguard/clip.h"
#include "nanguard/distributed.h"
#include "nanguard/step_signature.h"
#include "nanguard/training_host.h"

#include "guard/op_patch.h"
#include "guard/rank_agreement.h"
#include "guard/rank_case.h"
#include "guard/recovery.h"
#include "guard/remedy_trials.h"
#include "guard/step_record.h"
#include "guard/step_replay.h"

#include "detail/dtype_limits.h"
#include "detail/enum_from_string.h"
#include "detail/generator_states.h"
#include "detail/nonfinite_rows.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

namespace nanguard {

using detail::add_note;
using detail::message_of;
using detail::step_record;

namespace {

using step_clock = std::chrono::steady_clock;

// Prints one of the guard's lines on stderr after what the program printed
// on stdout before it: piped or written to a log, stdout is buffered, and
// the line would land pages ahead of the output it follows.
void say(const std::string& line) {
  std::fflush(stdout);
  fmt::print(stderr, "{}\n", line);
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

// What the guard did about a bad step: skipped or rolled back (to the
// snapshot of step `initial_step`: the initial weights), and how the LR and
// the loss scale changed.
std::string applied_remedy(const step_event& e, double lr_after, double scale_after, int64_t initial_step) {
  std::string r = e.action != action::rollback ? "skipped the step"
                  : e.rollback_to == initial_step
                      ? fmt::format("rolled back to the initial weights (the snapshot before step {})", initial_step + 1)
                      : fmt::format("rolled back to the snapshot of step {}", e.rollback_to);
  if (lr_after != e.lr) r += fmt::format("; lr {:.6g} -> {:.6g}", e.lr, lr_after);
  if (scale_after != e.scale) r += fmt::format("; loss scale {:.6g} -> {:.6g}", e.scale, scale_after);
  return r;
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

// The dataset indices given for batch tensor `t` (set_sample_indices), or null.
const std::vector<int64_t>* rows_of(const std::vector<std::pair<at::Tensor, std::vector<int64_t>>>& given,
                                    const at::Tensor& t) {
  for (const auto& [tensor, rows] : given)
    if (tensor.is_same(t)) return &rows;
  return nullptr;
}

// The first row (along dim 0) of `t` that holds a NaN/Inf, if any.
std::optional<int64_t> first_nonfinite_row(const at::Tensor& t) {
  if (!t.defined() || t.dim() == 0 || !at::isFloatingType(t.scalar_type())) return std::nullopt;
  const at::Tensor bad_rows = detail::nonfinite_rows(t).nonzero();
  if (bad_rows.numel() == 0) return std::nullopt;
  return bad_rows[0][0].item<int64_t>();
}

// Whether finding `f`'s op read batch tensor `name` elementwise: an input of
// that name shaped as the bad output, so the bad element's row is the tensor's.
bool reads_elementwise(const finding& f, const std::string& name) {
  if (f.output < 0 || size_t(f.output) >= f.outputs.size()) return false;
  const std::vector<int64_t>& shape = f.outputs[size_t(f.output)].shape;
  return std::any_of(f.inputs.begin(), f.inputs.end(),
                     [&](const tensor_record& in) { return in.name == name && in.shape == shape; });
}

}  // namespace

// The guard: a step is a record passed through stages, begin → measure →
// conclude → take | (localize → decide → act); what outlasts a step lives
// in the collaborators: recovery (the decision table, snapshots, rollback),
// step_replay (the replay and the live trace) and rank_agreement (the
// consensus of a distributed run).
struct guard::impl {
  impl(std::shared_ptr<training_host> h, guard_options opts);

  // ---- the stages of a step
  step_record begin(const micro_batches* batches, step_fn fn, std::optional<int64_t> number = std::nullopt);
  void measure(step_record& r);
  bool forward_backward(step_record& r);
  void backward(const at::Tensor& loss);
  void measured(step_record& r, bool losses_finite);
  void conclude(step_record& r);
  void take(step_record& r);
  void not_taken(step_event& e);
  void localize(step_record& r);
  void classify(step_record& r);
  void cross_check(step_record& r);
  bool peer_runs_finite(const step_record& r, const detail::rank_case& sent);
  bool redo(step_record& r);
  bool suspect(const step_record& r) const;
  bool audit(step_record& r);
  step_measure run_again(step_record& r);
  void verify_remedies(step_record& r);
  void act(const detail::decision& d, step_record& r);
  void roll_back(step_event& e, bool cut_lr);
  void back_off(step_event& e);
  [[noreturn]] void abort_step(step_record& r);

  // ---- around them
  void apply_schedule();
  double first_lr() const;
  void write(step_event& e);
  bool speaks(const step_event& e) const { return options.verbose() && e.rank <= 0; }
  // The collective the model's own backward runs (DDP, FSDP2), or none.
  backward_collective collective() const { return detail::collective_of(options); }
  diagnosis_context history(const step_event& e, const std::vector<at::Tensor>& batch) const;
  static void name_samples(step_record& r, const std::vector<std::string>& names);
  void drop_started();
  std::string write_repro_bundle(const step_record& r) const;
  finding thrown_finding(const step_record& r) const;
  void load_parameters(const named_tensors& saved);

  std::shared_ptr<training_host> host;
  guard_options options;
  loss_scaler scaler;
  nanguard::sentinel sentinel;
  std::optional<warmup_cosine> schedule;
  std::unique_ptr<event_log> log;
  std::vector<std::string> batch_names;  // set_batch_names
  bundle_tag_list bundle_tags = options.bundle_tags();
  double grad_limit;  // the largest value the gradients' dtype holds (the forecast's limit)
  std::optional<detail::rank_agreement> ranks;  // distributed only
  detail::step_replay replayer;
  detail::recovery recovery;
  detail::remedy_trials trials;
  // auto_fix: the verified op rewrite kept for the rest of the run, and its
  // scope over a step a framework runs (begin_step() to check()).
  std::unique_ptr<detail::op_patch> kept_patch;
  std::unique_ptr<detail::op_patch::scope> framework_step_patched;
  std::unique_ptr<fault_injector> injector;  // inject(): a planted fault
  int64_t fired_before = 0;                  // how often it had fired when this step began
  int64_t step = 0;           // the steps begun (steps())
  int64_t number_offset = 0;  // a step's number minus its count: begin_step(number) sets it
  int64_t number() const { return step + number_offset; }
  // set_sample_indices: the next step's batch tensors and their rows' dataset indices.
  std::vector<std::pair<at::Tensor, std::vector<int64_t>>> sample_indices;
  step_clock::time_point step_started;  // of the step being run
  double user_s = 0;                    // its seconds of plain-loop work (see user_time)
  // begin_step(): the step check() ends, when begin_step() returned (the
  // user's forward and backward run until check()) and the gradients then
  // (has a backward run since?).
  std::optional<step_record> started;
  step_clock::time_point begun;
  detail::gradient_marks started_gradients;
  std::optional<step_event> last;  // the last step's event
  run_narrator narrator;            // tells the user (options.verbose)
  bool running = false;             // a step (or check) is under way
};

guard::impl::impl(std::shared_ptr<training_host> h, guard_options opts)
    : host(std::move(h)), options(std::move(opts)), scaler(options.scaler()),
      sentinel(host->named_parameters(), options.spikes()),
      grad_limit(sentinel.parameters().empty() ? HUGE_VAL
                                               : detail::largest_finite(sentinel.parameters().front().scalar_type())),
      ranks(options.distributed() ? std::make_optional<detail::rank_agreement>(*options.distributed(), sentinel,
                                                                                scaler, options)
                                  : std::nullopt),
      replayer(*host, sentinel, scaler, options, batch_names),
      recovery(*host, scaler, options, ranks ? &*ranks : nullptr),
      trials(*host, replayer, recovery, sentinel, scaler, options) {}

// ---- the stages of a step

// Starts step `step + 1` (numbered `number`, or one above the last): its
// schedule, LR and loss scale, and the RNG state a replay starts from. The
// first step keeps the initial weights: what a rollback, or the check of an
// LR cut (verify_remedies), starts from.
step_record guard::impl::begin(const micro_batches* batches, step_fn fn, std::optional<int64_t> number) {
  step_started = step_clock::now();
  user_s = 0;
  step_record r;
  r.batches = batches;
  r.fn = std::move(fn);
  if (number) number_offset = *number - (step + 1);
  ++step;
  r.event.step = this->number();
  r.sample_indices = std::exchange(sample_indices, {});
  if (injector) {
    injector->set_step(r.event.step);
    injector->rewind();
    fired_before = injector->fired();
  }
  recovery.start(r.event.step, recovery.rolls_back() || (options.verify_remedies() && !ranks));
  if (schedule) apply_schedule();
  r.event.lr = first_lr();
  r.event.scale = scaler.get_scale();
  if (kept_patch) r.event.auto_fix = kept_patch->rewrite().description();
  r.rng_before = detail::capture_generators();
  return r;
}

// Forward, the loss check and the (scaled) backward of each micro-batch,
// then the sentinel's pass over the accumulated gradients.
void guard::impl::measure(step_record& r) {
  {
    user_time plain_work(user_s);
    host->zero_grad();
  }
  replayer.start_live_trace(*r.batches, number());
  measured(r, forward_backward(r));
}

// Forward, the loss check and the (scaled) backward of each micro-batch;
// returns whether every loss was finite (else `r.bad_batch` is the first
// that was not). The event's loss is their mean. Under a backward
// collective every micro-batch runs backward, a bad one too: the other
// ranks' backward waits for this one's.
bool guard::impl::forward_backward(step_record& r) {
  const size_t n = r.batches->size();
  double loss_sum = 0;
  bool finite = true;
  for (size_t i = 0; i < n; ++i) {
    at::Tensor loss;
    {
      user_time plain_work(user_s);
      loss = detail::loss_of(r.fn, (*r.batches)[i], sentinel.parameters());
    }
    r.loss_limit = detail::largest_finite(loss.scalar_type());
    double value = 0;
    if (!sentinel.check_loss(loss, &value) && finite) {
      finite = false;
      r.bad_batch = i;
      r.event.loss = value;
      if (collective() == backward_collective::none) return false;
    }
    loss_sum += value;
    user_time plain_work(user_s);
    backward(scaler.scale(detail::share_of(loss, n)));
  }
  if (finite) r.event.loss = loss_sum / double(n);
  return finite;
}

// A step's backward. Under a backward collective, when it fails because
// another rank has exited, the error names that rank.
void guard::impl::backward(const at::Tensor& loss) {
  try {
    loss.backward();
  } catch (const interrupted&) {
    throw;
  } catch (const std::exception& ex) {
    distributed* d = options.distributed().get();
    if (collective() == backward_collective::none || d->exited_ranks().empty()) throw;
    d->raise_failure(fmt::format("the model's {} in the backward of step {}", to_string(collective()), number()),
                     ex);
  }
}

// The end of a step's measurement, after its backward: the live trace's
// findings, then the sentinel's pass when every loss was finite. Sets
// whether all of it was finite here (under a backward collective: this
// rank's loss, and in a traced run its own gradients before the collective,
// as the host tells; the consensus learns the rest).
void guard::impl::measured(step_record& r, bool losses_finite) {
  step_event& e = r.event;
  replayer.finish_live_trace(e);
  const bool own_finite = host->backward_done();
  if (!losses_finite) {
    e.grad_norm = std::numeric_limits<double>::quiet_NaN();
    e.reason = "non-finite loss";
    r.locally_finite = false;
    return;
  }
  r.report = sentinel.inspect_grads(scaler.inv_scale());
  e.grad_norm = r.report.total_norm;
  e.signature = signature_of(e.loss, r.report);
  e.top_norms = detail::top_norms(sentinel.names(), r.report.norms, options.log_top_norms());
  r.locally_finite = collective() == backward_collective::none ? r.report.finite() : own_finite;
  if (!r.locally_finite) e.reason = "non-finite gradient";
}

// The rest of a measured step, the same for guard::step and guard::check:
// the consensus (distributed), then take a finite step, or localize the bad
// one, decide and act (abort throws).
void guard::impl::conclude(step_record& r) {
  step_event& e = r.event;
  const bool finite = ranks ? ranks->agree(r, e.step) && ranks->checksums_agree(e, e.step) : r.locally_finite;
  if (finite) {
    e.spikes = sentinel.observe(e.loss, e.grad_norm);
    e.forecast = sentinel.forecast(r.loss_limit, grad_limit / scaler.get_scale());
    if (suspect(r) && audit(r)) return take(r);
    recovery.observe_finite(e);
    r.runaway = recovery.running_away();
    if (!r.runaway) return take(r);
    not_taken(e);
  } else {
    localize(r);
    classify(r);
    if (ranks) cross_check(r);
    if (e.fault == fault_class::transient && redo(r)) return take(r);
    recovery.remember_bad_batch(r);
    not_taken(e);
  }
  // A faulty device: training on would go on computing with it.
  act(e.fault == fault_class::persistent ? detail::decision{policy::abort, "", false} : recovery.decide(r), r);
}

// Hardware or software, from what the replay found: a NaN/Inf the replay
// made again came with the batch (data) or from the model's numerics; one
// only the compiled code makes is the compiler's; one a run of the same
// step from the same state did not make was a transient fault.
void guard::impl::classify(step_record& r) {
  step_event& e = r.event;
  const bool named = !e.findings.empty() && (e.verdict == verdict::reproduced || r.quarantined);
  if (e.verdict == verdict::not_reproduced) e.fault = fault_class::transient;
  else if (e.verdict == verdict::compiled_only) e.fault = fault_class::compiler;
  else if (named) e.fault = e.findings.front().diagnosis.cause == cause::bad_data ? fault_class::data : fault_class::model;
}

// Distributed, the guard averaging the gradients: the origin rank's bad
// micro-batch and RNG state go to the next rank, which runs the step on
// them. When the origin made the NaN/Inf again and the peer does not, the
// origin's device computed it: a persistent fault of that rank. Every rank
// takes part (two broadcasts) and ends with the origin's class.
void guard::impl::cross_check(step_record& r) {
  step_event& e = r.event;
  distributed& d = *options.distributed();
  if (d.world_size() < 2 || e.nonfinite_ranks.empty() || collective() != backward_collective::none) return;
  const int64_t origin = e.nonfinite_ranks.front(), peer = (origin + 1) % d.world_size();
  std::string mine;
  if (d.rank() == origin) mine = detail::rank_case{e.fault, detail::host_name(), r.bad_micro_batch(), r.rng_before.cpu}.to_bytes();
  const detail::rank_case sent = detail::rank_case::from_bytes(d.broadcast(mine, origin));
  e.fault = sent.fault;
  if (sent.fault != fault_class::model && sent.fault != fault_class::data) return;  // only what reproduces
  std::string answer;
  if (d.rank() == peer) answer = !r.fn ? "unknown" : peer_runs_finite(r, sent) ? "finite" : "nonfinite";
  answer = d.broadcast(answer, peer);
  if (answer == "nonfinite") {
    add_note(e.note, fmt::format("rank {} ran rank {}'s micro-batch from the same state and made it too: not a "
                                 "device fault", peer, origin));
    return;
  }
  if (answer != "finite") return;
  e.fault = fault_class::persistent;
  add_note(e.note, fmt::format("persistent fault on rank {} (host {}): it makes the NaN/Inf again, and rank {} "
                               "given the same micro-batch and state does not: a faulty device; restart the job "
                               "without it",
                               origin, sent.host.empty() ? "unknown" : sent.host, peer));
}

// The peer's run of the origin's micro-batch, from the origin's RNG state,
// on its own parameters (the same: the guard averages the gradients).
bool guard::impl::peer_runs_finite(const step_record& r, const detail::rank_case& sent) {
  step_record probe;
  probe.fn = r.fn;
  probe.event.step = r.event.step;
  probe.rng_before = r.rng_before;
  probe.rng_before.cpu = sent.rng;
  std::vector<at::Tensor> batch = sent.batch;
  const std::vector<at::Tensor>& own = r.bad_micro_batch();
  for (size_t j = 0; j < batch.size() && j < own.size(); ++j)
    if (batch[j].defined() && own[j].defined()) batch[j] = batch[j].to(own[j].device());
  const micro_batches batches{batch};
  probe.batches = &batches;
  const bool finite = replayer.rerun(probe, batches, scaler.get_scale(), /*traced=*/false).finite;
  host->zero_grad();
  return finite;
}

// A transient fault: the step runs again from the same state (one process;
// not under abort, which stops at the first NaN/Inf) and, finite, is taken
// with that run's gradients instead of being lost.
bool guard::impl::redo(step_record& r) {
  step_event& e = r.event;
  if (ranks || !r.fn || options.policy() == policy::abort) return false;
  const step_measure again = run_again(r);
  if (!again.grads.finite() || !std::isfinite(again.loss)) return false;
  add_note(e.note, fmt::format("redone: the replay did not make the {}, the step ran again from the same state "
                               "(loss {:.6g}) and was taken: a transient fault", e.reason, again.loss));
  e.reason.clear();
  e.nonfinite_params.clear();
  e.spikes = sentinel.observe(e.loss, e.grad_norm);
  recovery.observe_finite(e);
  return true;
}

// Whether a finite step is worth a second run: a loss or grad-norm spike
// (replay_spikes), or a step the audit samples (audit_every). One process,
// with the step's function (a framework's replay).
bool guard::impl::suspect(const step_record& r) const {
  if (ranks || !r.fn || collective() != backward_collective::none) return false;
  const bool spiked = !r.event.spikes.empty() && options.replay_spikes();
  const bool audited = options.audit_every() > 0 && r.event.step % options.audit_every() == 0;
  return spiked || audited;
}

// Runs a suspect finite step again and compares the two runs' signatures.
// When they are not bit-identical a third run decides: the two that are
// agree are right, the odd one was a transient fault (the original: the
// step is redone; the second: the audit's own run was hit); three that
// differ say the run is not deterministic. Bit for bit, because a fault
// too small to spike moves the values by less than any tolerance; the
// third run keeps a non-deterministic kernel from being called a fault.
// Returns whether the step was taken with other gradients than its own
// (they are in place either way).
bool guard::impl::audit(step_record& r) {
  step_event& e = r.event;
  const step_measure first{e.loss, r.report}, second = run_again(r);
  if (compare(first, second) == signature_match::identical) return false;
  const step_measure third = run_again(r);
  const bool first_right = compare(first, third) == signature_match::identical;
  const bool second_right = compare(second, third) == signature_match::identical;
  if (first_right) {
    e.fault = fault_class::transient;
    add_note(e.note, "audit: a second run of the step differed and a third agreed with the first: a transient "
                     "fault in the second run; the step was taken");
    return false;
  }
  if (!second_right) {
    add_note(e.note, "audit: three runs of the step from the same state differ: the run is not deterministic "
                     "(docs/hardware-or-software.md says what to turn on); the step was taken as run last");
    return true;
  }
  e.fault = fault_class::transient;
  add_note(e.note, fmt::format("redone: two more runs of the step from the same state agree (loss {:.6g}, grad "
                               "norm {:.6g}) and differ from it (loss {:.6g}, grad norm {:.6g}): a transient "
                               "fault; the step was taken as they computed it",
                               third.loss, third.grads.total_norm, e.loss, e.grad_norm));
  return true;
}

// Runs the step again from its state and RNG, untraced, and measures it;
// its gradients stay in place, the event holds its loss, grad norm and
// signature.
step_measure guard::impl::run_again(step_record& r) {
  step_event& e = r.event;
  const detail::rerun_outcome o = replayer.rerun(r, *r.batches, scaler.get_scale(), /*traced=*/false);
  r.report = o.report;
  e.loss = o.loss;
  e.grad_norm = o.report.total_norm;
  e.top_norms = detail::top_norms(sentinel.names(), r.report.norms, options.log_top_norms());
  e.signature = signature_of(e.loss, r.report);
  return {e.loss, r.report};
}

// A finite step: unscale + clip in one write, the optimizer steps (unless a
// framework steps it), a calm step may become the snapshot to roll back to.
void guard::impl::take(step_record& r) {
  step_event& e = r.event;
  e.clip_coef = clip_coefficient(e.grad_norm, options.max_norm());
  sentinel.apply_factor_(scaler.inv_scale() * e.clip_coef);
  if (options.clip_value() > 0) clip_grad_value_(sentinel.parameters(), options.clip_value());
  {
    user_time plain_work(user_s);
    if (r.step_optimizer) host->optimizer_step();
  }
  scaler.update(false);
  recovery.count_taken();
  if (recovery.rolls_back()) recovery.snapshot_if_due(e, seconds_since(step_started));
  write(e);
}

// A step the optimizer does not take: its gradients go, and it is counted bad.
void guard::impl::not_taken(step_event& e) {
  host->zero_grad();
  e.skipped = true;
  recovery.count_not_taken();
}

// A bad step: which parameters, and the replay that names the op (where the
// problem was seen; distributed, its finding reaches every rank), then the
// diagnosis of each finding. Nothing is stepped.
void guard::impl::localize(step_record& r) {
  step_event& e = r.event;
  for (size_t i = 0; i < r.report.nonfinite_counts.size(); ++i)
    if (r.report.nonfinite_counts[i] > 0)
      e.nonfinite_params.push_back({sentinel.names()[i], r.report.nonfinite_counts[i]});
  // Under a backward collective the step is bad on every rank, and every
  // rank replays it (the model's collectives run again).
  const bool collective_step = collective() != backward_collective::none;
  std::optional<bool> own_bad;  // in the replay: this rank's own loss or gradients were not finite
  r.quarantined = recovery.quarantined(r);  // auto: its first findings stand
  if (!r.quarantined && options.replay() && !options.trace_every_step() && r.fn &&
      (collective_step || !r.locally_finite))
    own_bad = replayer.replay(r);
  if (collective_step && e.nonfinite_ranks.empty()) ranks->name_origin(own_bad, e, e.step);
  if (ranks && (options.replay() || options.trace_every_step())) ranks->share_findings(e);
  if (collective_step && !detail::rank_agreement::is_origin(e)) ranks->note_received(r.report, e);
  if (r.batches->size() > 1 && !r.locally_finite)
    add_note(e.note, fmt::format("micro-batch {} of {}", r.bad_batch, r.batches->size()));
  const diagnosis_context h = history(e, r.bad_micro_batch());
  for (finding& f : e.findings) f.diagnosis = diagnose(f, h);
  name_samples(r, batch_names);
  verify_remedies(r);
}

// Tries the remedies of the step's first finding on replays of the step and
// records the checks on it; auto_fix keeps the first verified op rewrite.
// Only where the step was replayed and made its NaN/Inf again (or traced
// live), in one process (a replay on one rank would run collectives alone).
void guard::impl::verify_remedies(step_record& r) {
  step_event& e = r.event;
  const bool reproduced = e.verdict == verdict::reproduced || (options.trace_every_step() && e.verdict == verdict::none);
  if (!options.verify_remedies() || ranks || !r.fn || r.quarantined || e.findings.empty() || !reproduced) return;
  detail::remedy_trials::outcome o = trials.check(e.findings.front(), r, kept_patch.get());
  e.findings.front().remedy_checks = std::move(o.checks);
  if (!options.auto_fix() || kept_patch || !o.verified_rewrite) return;
  kept_patch = std::make_unique<detail::op_patch>(*o.verified_rewrite, /*count_changes=*/false);
  e.auto_fix = kept_patch->rewrite().description();
  add_note(e.note, "auto_fix: " + e.auto_fix + " from the next step on");
}

// Applies the decision and records the event. The loss scaler backs off on
// every non-finite step (GradScaler semantics). Abort writes the bundle and
// throws.
void guard::impl::act(const detail::decision& d, step_record& r) {
  step_event& e = r.event;
  if (!d.note.empty()) add_note(e.note, d.note);
  e.action = action_of(d.policy);
  switch (d.policy) {
    case policy::abort: abort_step(r);
    case policy::automatic:  // decide() has chosen
    case policy::skip: break;
    case policy::backoff:
      if (!scaler.enabled()) add_note(e.note, "loss scaling is disabled: the step was skipped");
      break;
    case policy::rollback: roll_back(e, d.cut_lr); break;
  }
  back_off(e);
  e.remedy = applied_remedy(e, first_lr(), scaler.get_scale(), recovery.initial_step());
  write(e);
}

// Restores the newest calm snapshot and, with `cut_lr`, lowers the LR:
// every param group's, or the schedule's factor.
void guard::impl::roll_back(step_event& e, bool cut_lr) {
  const double factor = recovery.roll_back(e, cut_lr);
  if (schedule) apply_schedule();
  else if (factor != 1) scale_lrs(*host, factor);
  sentinel.reset_spikes();  // the windows hold the divergence
}

void guard::impl::back_off(step_event& e) {
  try {
    scaler.update(true);
  } catch (const std::exception& ex) {
    add_note(e.note, message_of(ex));
    write(e);
    throw;
  }
}

// Writes the repro bundle (distributed: the first rank that saw it, with
// its batch), records the event and throws nonfinite_error.
void guard::impl::abort_step(step_record& r) {
  step_event& e = r.event;
  e.remedy = "stopped training";
  const int64_t writer = e.nonfinite_ranks.empty() ? 0 : e.nonfinite_ranks.front();
  if (options.bundle_dir().empty()) {
    // no bundle asked for
  } else if (!ranks || e.rank == writer) {
    try {
      e.bundle = write_repro_bundle(r);
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
  throw nonfinite_error(thrown_finding(r));
}

// ---- around them

// Sets every param group's LR to the schedule's for this step, times the
// rollback factors.
void guard::impl::apply_schedule() {
  host->set_lrs(std::vector<double>(host->lrs().size(), schedule->lr(step - 1) * recovery.lr_factor()));
}

// The LR of the first param group (0 when there is none).
double guard::impl::first_lr() const {
  const std::vector<double> lrs = host->lrs();
  return lrs.empty() ? 0.0 : lrs.front();
}

// Stamps the guard's own time so far on `e` and logs it; a bad step is a
// warning on stderr too (verbose; distributed: rank 0's).
void guard::impl::write(step_event& e) {
  e.guard_ms = (seconds_since(step_started) - user_s) * 1e3;
  if (injector && injector->fired() > fired_before)  // first: what was planted, then what the guard made of it
    e.note = "injected: " + injector->last_fired() + (e.note.empty() ? "" : "; " + e.note);
  last = e;
  if (log) log->write(e);
  const std::string& warning = narrator.observe(e);
  if (!warning.empty() && speaks(e)) say(warning);
}

// What the guard knows of the bad step `e` besides its findings.
diagnosis_context guard::impl::history(const step_event& e, const std::vector<at::Tensor>& batch) const {
  diagnosis_context c;
  c.losses.assign(recovery.losses().begin(), recovery.losses().end());
  if (std::isfinite(e.loss)) c.losses.push_back(e.loss);  // a finite loss, gradients not
  c.grad_norms.assign(recovery.grad_norms().begin(), recovery.grad_norms().end());
  c.lr = e.lr;
  c.loss_scale = e.scale;
  for (size_t i = 0; i < batch.size(); ++i) c.data.push_back(detail::batch_name(batch_names, i));
  c.front_end = options.front_end();
  c.data_file = options.data_file();
  return c;
}

// Each finding that reads a batch tensor of the bad micro-batch whose rows
// the user gave (set_sample_indices) gets the dataset index of its bad row:
// the tensor's first non-finite row when it is the culprit, else (an
// elementwise op on it: the same shape in and out) the bad element's row.
void guard::impl::name_samples(step_record& r, const std::vector<std::string>& names) {
  if (r.sample_indices.empty()) return;
  const std::vector<at::Tensor>& batch = r.bad_micro_batch();
  for (finding& f : r.event.findings) {
    const std::vector<int64_t> position = element_position(f);
    for (size_t j = 0; j < batch.size() && f.dataset_index < 0; ++j) {
      const std::vector<int64_t>* rows = rows_of(r.sample_indices, batch[j]);
      if (rows == nullptr) continue;
      const std::string name = detail::batch_name(names, j);
      std::optional<int64_t> row;
      if (f.role == role::input && f.culprit == name) row = first_nonfinite_row(batch[j]);
      else if (reads_elementwise(f, name) && !position.empty()) row = position.front();
      if (row && *row >= 0 && *row < int64_t(rows->size())) f.dataset_index = (*rows)[*row];
    }
  }
}

// Forgets the step begun last, uncounted, and its trace: cancel_step(), a
// check() with no backward before it, a step whose function threw.
void guard::impl::drop_started() {
  started.reset();
  sample_indices.clear();
  framework_step_patched.reset();
  replayer.drop_live_trace();
  --step;
}

// Writes the repro bundle of a bad step; returns its directory. The
// culprit's inputs are those the replay's tracer kept.
std::string guard::impl::write_repro_bundle(const step_record& r) const {
  const step_event& e = r.event;
  bundle b;
  b.step = e.step;
  b.lr = e.lr;
  b.scale = e.scale;
  b.loss = e.loss;
  b.policy = options.policy();
  b.verdict = e.verdict;
  b.batch = r.bad_micro_batch();
  b.rng_state = r.rng_before.cpu;
  b.cuda_rng_states = r.rng_before.cuda;
  if (!e.findings.empty()) b.finding = e.findings.front();
  b.note = e.note;  // a NaN only the compiled code makes: its stage, kernel and remedy
  if (options.bundle_parameters()) b.parameters = host->named_parameters();
  if (b.finding && b.finding->role == role::producer) b.culprit_inputs = b.finding->input_values;
  b.tags = bundle_tags;
  return write_bundle(options.bundle_dir(), b);
}

// What abort throws: the first finding, or when the replay named no op one
// naming the first bad parameter, the loss, or (all finite: the gradient
// checksums differed) the averaged gradients.
finding guard::impl::thrown_finding(const step_record& r) const {
  const step_event& e = r.event;
  if (!e.findings.empty()) return e.findings.front();
  finding f;
  f.step = e.step;
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
  if (ranks) f.rank = e.nonfinite_ranks.empty() ? e.rank : e.nonfinite_ranks.front();
  f.diagnosis = diagnose(f, history(e, r.bad_micro_batch()));
  return f;
}

// Copies `saved` into the host's parameters of the same names (a bundle's).
void guard::impl::load_parameters(const named_tensors& saved) {
  const named_tensors own = host->named_parameters();
  const at::NoGradGuard no_grad;
  for (const auto& [name, value] : saved) {
    // Captured by name: a lambda capturing a structured binding is C++20 (clang 14 refuses it).
    const auto it =
        std::find_if(own.begin(), own.end(), [&wanted = name](const auto& p) { return p.first == wanted; });
    TORCH_CHECK(it != own.end(), "nanguard::guard::replay: the bundle's parameter '", name,
                "' is not in the model; replay with the model the bundle was written from");
    TORCH_CHECK(it->second.sizes().equals(value.sizes()), "nanguard::guard::replay: the bundle's parameter '", name,
                "' is ", value.sizes(), " but the model's is ", it->second.sizes(),
                "; replay with the model the bundle was written from");
    it->second.detach().copy_(value);
  }
}

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
  TORCH_CHECK(o.snapshot_memory_mb() >= 0 && std::isfinite(o.snapshot_memory_mb()),
              "nanguard::guard_options: snapshot_memory_mb must be finite and >= 0 but is ", o.snapshot_memory_mb(),
              "; 0 lets the snapshots hold a quarter of this machine's memory");
  TORCH_CHECK(o.rollback_lr_factor() > 0 && o.rollback_lr_factor() <= 1,
              "nanguard::guard_options: rollback_lr_factor must be in (0, 1] but is ", o.rollback_lr_factor(),
              "; e.g. 0.5 halves the LR on every rollback");
  TORCH_CHECK(o.max_bad_steps() >= 0, "nanguard::guard_options: max_bad_steps must be >= 0 but is ",
              o.max_bad_steps(), "; 0 never aborts on its own");
  TORCH_CHECK(o.max_bad_fraction() > 0 && o.max_bad_fraction() <= 1,
              "nanguard::guard_options: max_bad_fraction must be in (0, 1] but is ", o.max_bad_fraction(),
              "; 1 never aborts on its own, 0.5 aborts when most recent steps are bad");
  TORCH_CHECK(o.audit_every() >= 0, "nanguard::guard_options: audit_every must be >= 0 but is ", o.audit_every(),
              "; 0 audits no step, 100 runs every 100th step twice");
  TORCH_CHECK(o.log_top_norms() >= 0, "nanguard::guard_options: log_top_norms must be >= 0 but is ",
              o.log_top_norms(), "; 0 lists no per-parameter norm, 5 is the default");
  TORCH_CHECK(o.spike_rollback_z() >= 0 && std::isfinite(o.spike_rollback_z()),
              "nanguard::guard_options: spike_rollback_z must be finite and >= 0 but is ", o.spike_rollback_z(),
              "; 0 turns the spike rollback off, 100 is the default");
  TORCH_CHECK(!o.auto_fix() || o.verify_remedies(),
              "nanguard::guard_options: auto_fix keeps a verified remedy, but verify_remedies is false; set "
              "verify_remedies(true) or auto_fix(false)");
  TORCH_CHECK(!host->lrs().empty(),
              "nanguard::guard: the optimizer has no param groups; make it with model->parameters()");
  impl_ = std::make_unique<impl>(std::move(host), std::move(options));
  impl& s = *impl_;
  if (s.options.schedule()) s.schedule.emplace(*s.options.schedule());
  if (!s.options.event_log().empty())
    s.log = std::make_unique<event_log>(s.options.event_log(), s.options.truncate_event_log());
  if (s.ranks) s.ranks->check_same_parameters();        // a collective: every rank builds its guard
  if (const char* planted = std::getenv("NANGUARD_INJECT"); planted != nullptr && *planted != '\0') {
    try {
      inject(fault_spec_from_string(planted));
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "nanguard::guard: NANGUARD_INJECT='", planted, "': ", e.what_without_backtrace());
    }
  }
}

guard::~guard() {
  const impl& s = *impl_;
  if (s.last && eventful(s.narrator.summary()) && s.speaks(*s.last))
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
  std::optional<detail::op_patch::scope> patched;  // auto_fix
  if (s.kept_patch) patched.emplace();
  // A rollback that keeps the batch (rollback_skip_batch false) runs it once more.
  for (bool again = false;; again = true) {
    step_record r = s.begin(&batches, fn);
    try {
      s.measure(r);
    } catch (...) {
      s.drop_started();  // the caller's error: no step was taken, and the next one takes this number
      throw;
    }
    s.conclude(r);
    if (r.event.action != action::rollback || s.options.rollback_skip_batch() || again) return r.event;
  }
}

void guard::begin_step(std::optional<int64_t> number) {
  impl& s = *impl_;
  const one_step_at_a_time running(s.running, "begin_step");
  TORCH_CHECK(!number || (*number >= 0 && (s.step == 0 || *number > s.number())), "nanguard::guard::begin_step: step ",
              number.value_or(0), " must be >= 0 and above the last step's (", s.number(),
              "); pass the framework's step counter, which only grows, or none to count from 1");
  s.started = s.begin(/*batches=*/nullptr, {}, number);  // check() gives them
  s.started_gradients = detail::mark_gradients(s.sentinel.parameters());
  if (s.kept_patch) s.framework_step_patched = std::make_unique<detail::op_patch::scope>();  // the framework's step
  s.replayer.start_live_trace({}, s.number());
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
  const std::unique_ptr<detail::op_patch::scope> patched = std::move(s.framework_step_patched);  // ends with check
  step_record r = std::move(*s.started);
  for (auto& rows : std::exchange(s.sample_indices, {})) r.sample_indices.push_back(std::move(rows));
  const micro_batches batches{batch};
  r.batches = &batches;
  r.fn = replay;
  r.step_optimizer = false;
  r.loss_limit = detail::largest_finite(loss.scalar_type());
  const bool loss_finite = s.sentinel.check_loss(loss, &r.event.loss);
  s.measured(r, loss_finite);  // the host's gradients, as backward left them
  if (loss_finite && !detail::gradients_written_since(s.sentinel.parameters(), s.started_gradients)) {
    s.drop_started();  // not counted: begin it again
    TORCH_CHECK(false, "nanguard::guard::check: no backward wrote a gradient since begin_step(); call "
                "loss.backward() before check(loss): the guard checks the gradients it made (a framework that "
                "skips the step calls cancel_step() instead)");
  }
  s.started.reset();
  s.conclude(r);
  return r.event;
}

step_event guard::replay(const bundle& b, const step_fn& fn) {
  impl& s = *impl_;
  s.load_parameters(b.parameters);
  step_record r;
  const micro_batches batches{b.batch};
  r.batches = &batches;
  r.fn = fn;
  r.event.step = b.step;
  r.event.loss = b.loss;
  r.event.lr = s.first_lr();
  r.event.scale = s.scaler.get_scale();
  r.rng_before = detail::capture_generators();
  if (b.rng_state.defined() && b.rng_state.numel() > 0) r.rng_before.cpu = b.rng_state;
  // The bundle's CUDA generators for the devices this machine has (a CPU
  // run on a GPU machine bundles them too; replayed on a CPU, none is used).
  for (size_t i = 0; i < r.rng_before.cuda.size() && i < b.cuda_rng_states.size(); ++i)
    r.rng_before.cuda[i] = b.cuda_rng_states[i];
  s.replayer.replay(r);
  r.event.skipped = true;  // nothing was stepped
  return r.event;
}

void guard::set_bundle_tags(bundle_tag_list tags) { impl_->bundle_tags = std::move(tags); }

void guard::set_batch_names(std::vector<std::string> names) { impl_->batch_names = std::move(names); }

void guard::inject(const fault_spec& spec) {
  impl& s = *impl_;
  const int64_t rank = s.options.distributed() ? s.options.distributed()->rank() : 0;
  const int64_t world = s.options.distributed() ? s.options.distributed()->world_size() : 1;
  TORCH_CHECK(spec.rank() < world, "nanguard::guard::inject: rank ", spec.rank(), " is not in the guard's group of ",
              world, world == 1 ? " process (rank 0)" : " ranks", "; name a rank from 0 to ", world - 1,
              " or -1 for every rank");
  TORCH_CHECK(s.step == 0 || spec.step() > s.number(), "nanguard::guard::inject: step ", spec.step(),
              " has passed (the last step was ", s.number(), "); name a step from ", s.number() + 1, " on");
  s.injector.reset();  // one armed at a time: the new one replaces it
  s.injector = std::make_unique<fault_injector>(spec, rank);
}

void guard::set_sample_indices(const at::Tensor& t, std::vector<int64_t> indices) {
  TORCH_CHECK(t.defined() && t.dim() > 0 && t.size(0) == int64_t(indices.size()),
              "nanguard::guard::set_sample_indices: ", indices.size(), " dataset indices for a tensor of ",
              t.defined() && t.dim() > 0 ? fmt::format("{} rows", t.size(0)) : std::string("no rows"),
              "; give one index per row (dim 0) of the batch tensor");
  impl_->sample_indices.emplace_back(t, std::move(indices));
}

const step_event& guard::last_event() const {
  TORCH_CHECK(impl_->last, "nanguard::guard::last_event: no step has ended yet");
  return *impl_->last;
}

int64_t guard::steps() const { return impl_->step; }
int64_t guard::skipped() const { return impl_->recovery.skipped(); }
int64_t guard::rollbacks() const { return impl_->recovery.rollbacks(); }
double guard::lr_factor() const { return impl_->recovery.lr_factor(); }
loss_scaler& guard::scaler() { return impl_->scaler; }
nanguard::sentinel& guard::sentinel() { return impl_->sentinel; }
snapshot_ring& guard::snapshots() { return impl_->recovery.ring(); }
const guard_options& guard::options() const { return impl_->options; }
const run_narrator& guard::narrator() const { return impl_->narrator; }

}  // namespace nanguard
