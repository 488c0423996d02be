#include "guard/step_replay.h"

#include "detail/armed_fault.h"

#include "nanguard/finding.h"

#include <ATen/ATen.h>
#include <torch/csrc/jit/runtime/graph_executor.h>

namespace nanguard::detail {

traced_run::traced_run(training_host& host)
    : end_(host.begin_traced_run()), script_optimized_(torch::jit::getGraphExecutorOptimize()) {
  torch::jit::setGraphExecutorOptimize(false);
}

traced_run::~traced_run() {
  torch::jit::setGraphExecutorOptimize(script_optimized_);
  if (end_) end_();
}

step_replay::step_replay(training_host& host, const sentinel& sentinel, loss_scaler& scaler,
                         const guard_options& options, const std::vector<std::string>& batch_names)
    : host_(host), sentinel_(sentinel), scaler_(scaler), options_(options), batch_names_(batch_names) {}

void step_replay::start_live_trace(const micro_batches& batches, int64_t step) {
  if (!options_.trace_every_step()) return;
  drop_live_trace();  // a step begun and never checked
  live_.emplace(options_.tracer());
  name_tensors(*live_, batches, step);
  live_run_.emplace(host_);
}

void step_replay::finish_live_trace(step_event& e) {
  if (!live_) return;
  live_run_.reset();
  e.findings = live_->findings();
  live_.reset();
}

void step_replay::drop_live_trace() {
  live_run_.reset();
  live_.reset();
}

// Tags a tracer's findings with step `step` and names what they may name:
// the parameters and the tensors of every micro-batch.
void step_replay::name_tensors(tracer& t, const micro_batches& batches, int64_t step) const {
  t.name_parameters(host_.named_parameters());
  t.set_step(step);
  for (const auto& batch : batches)
    for (size_t j = 0; j < batch.size(); ++j)
      if (batch[j].defined()) t.name_tensor(batch[j], batch_name(batch_names_, j));
}

bool step_replay::replay(step_record& r) {
  step_event& e = r.event;
  const generator_states rng_after = capture_generators();
  host_.zero_grad();
  restore_generators(r.rng_before);
  rewind_armed_fault();  // a run of the step: an injected fault's calls are counted again
  bool reproduced = false, failed = false, own_bad = false;
  // Under a backward collective every micro-batch runs on every rank,
  // whatever this rank's tracer found: the other ranks' collectives wait for it.
  const bool collective_replay = collective_of(options_) != backward_collective::none;
  try {
    // keep_inputs: the bundle's culprit inputs; no range rules: a faulty
    // device's output is read, not inferred from its inputs.
    tracer t(tracer_options(options_.tracer()).keep_inputs(true).range_rules(false));
    name_tensors(t, *r.batches, e.step);
    const traced_run run(host_);
    try {
      for (size_t i = 0; i < r.batches->size(); ++i) {
        const bool loss_ok = forward_backward((*r.batches)[i], r.fn, r.batches->size(), t);
        own_bad = own_bad || !loss_ok;
        if ((!loss_ok || t.found()) && !reproduced) {
          reproduced = true;
          r.bad_batch = i;
          if (!collective_replay) break;
        }
      }
      tracer_pause pause(t);
      // This rank's own gradients: a collective's others may hold what another rank sent.
      const bool own_finite = host_.backward_done();
      own_bad = own_bad || !own_finite;
      if (!reproduced)
        reproduced = collective_replay ? !own_finite : !sentinel_.inspect_grads(scaler_.inv_scale()).finite();
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
  if (!failed && !reproduced && !collective_replay) bisect_compiled(r);
  host_.zero_grad();
  restore_generators(rng_after);
  return own_bad;
}

rerun_outcome step_replay::rerun(const step_record& r, const micro_batches& batches, double scale, bool traced) {
  const generator_states rng_after = capture_generators();
  host_.zero_grad();
  restore_generators(r.rng_before);
  rewind_armed_fault();  // a run of the step: an injected fault's calls are counted again
  rerun_outcome out;
  try {
    std::optional<tracer> t;
    if (traced) {
      t.emplace(options_.tracer());
      name_tensors(*t, batches, r.event.step);
    }
    bool finite = true;
    double sum = 0;
    for (const auto& batch : batches) {
      const at::Tensor loss = loss_of(r.fn, batch, sentinel_.parameters());
      double value = 0;
      finite = sentinel_.check_loss(loss, &value);
      sum += value;
      if (!finite) {
        if (t) t->judge_by_outputs({loss});
        break;
      }
      const at::Tensor share = share_of(loss, batches.size());
      (scale == 1 ? share : share * scale).backward();  // scaler_.scale(share) at the scaler's scale
    }
    std::optional<tracer_pause> pause;
    if (t) pause.emplace(*t);
    if (finite && host_.backward_done()) {
      out.report = sentinel_.inspect_grads(1.0 / scale);
      out.finite = out.report.finite();
      out.grad_norm = out.report.total_norm;
    }
    out.loss = finite ? sum / double(batches.size()) : std::numeric_limits<double>::quiet_NaN();
    if (t && !out.finite && t->found()) out.first_finding = to_string(t->findings().front());
  } catch (...) {
    restore_generators(rng_after);
    throw;
  }
  restore_generators(rng_after);
  return out;
}

// One micro-batch of the replay; returns whether its loss was finite. Its
// backward runs on a bad loss too when the model's backward is a collective
// (the other ranks' backward waits for it).
bool step_replay::forward_backward(const std::vector<at::Tensor>& batch, const step_fn& fn, size_t n, tracer& t) {
  const at::Tensor loss = loss_of(fn, batch, sentinel_.parameters());
  bool loss_ok;
  {
    tracer_pause pause(t);
    loss_ok = sentinel_.check_loss(loss);
  }
  if (loss_ok || collective_of(options_) != backward_collective::none) scaler_.scale(share_of(loss, n)).backward();
  else t.judge_by_outputs({loss});  // no backward to judge the chains: what reaches the loss does
  return loss_ok;
}

// A compiled model whose eager replay stayed finite: the host runs the step
// again under each stage of the compiler; the stage that makes the NaN/Inf
// again gives the verdict "compiled only" and the note.
void step_replay::bisect_compiled(step_record& r) {
  const auto step_finite = [&] { return rerun(r, *r.batches, scaler_.get_scale(), /*traced=*/false).finite; };
  try {
    const std::string stage = host_.bisect_compiled(step_finite);
    if (stage.empty()) return;
    r.event.verdict = verdict::compiled_only;
    add_note(r.event.note, stage);
  } catch (const interrupted&) {
    throw;
  } catch (const std::exception& ex) {
    add_note(r.event.note, "bisecting the compiled model failed: " + message_of(ex));
  }
}

}  // namespace nanguard::detail
