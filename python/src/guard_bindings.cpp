// guard_bindings.cpp — the guard over a Python training host, and its distributed consensus.
#include "bindings.h"

#include <nanguard/distributed.h>
#include <nanguard/events.h>
#include <nanguard/guard.h>
#include <nanguard/policy.h>
#include <nanguard/run_summary.h>
#include <nanguard/training_host.h>

#include <algorithm>
#include <optional>

namespace {

/// A Python object, released with the GIL held (the guard may drop it on a
/// thread that does not hold it).
struct gil_object {
  py::object object;
  ~gil_object() {
    py::gil_scoped_acquire gil;
    object = py::object();
  }
};

/// What the Python host saved: its object, and the parameters (saved_state).
struct py_saved_state : nanguard::saved_state {
  std::shared_ptr<gil_object> state;
};

/// A training_host whose methods a Python subclass implements
/// (nanguard._hosts: an nn.Module, a DistributedDataParallel or FSDP2 one, and a torch.optim optimizer).
class py_training_host : public nanguard::training_host {
 public:
  nanguard::named_tensors named_parameters() override {
    PYBIND11_OVERRIDE_PURE(nanguard::named_tensors, nanguard::training_host, named_parameters, );
  }
  void zero_grad() override { PYBIND11_OVERRIDE_PURE(void, nanguard::training_host, zero_grad, ); }
  void optimizer_step() override { PYBIND11_OVERRIDE_PURE(void, nanguard::training_host, optimizer_step, ); }
  std::vector<double> lrs() override { PYBIND11_OVERRIDE_PURE(std::vector<double>, nanguard::training_host, lrs, ); }
  void set_lrs(const std::vector<double>& lrs) override {
    PYBIND11_OVERRIDE_PURE(void, nanguard::training_host, set_lrs, lrs);
  }
  bool backward_done() override { PYBIND11_OVERRIDE(bool, nanguard::training_host, backward_done, ); }
  int64_t state_bytes() override { PYBIND11_OVERRIDE(int64_t, nanguard::training_host, state_bytes, ); }
  // Python's save() returns (state, [(name, parameter copy)]).
  std::shared_ptr<const nanguard::saved_state> save() override {
    py::gil_scoped_acquire gil;
    const py::tuple saved = call("save")();
    auto s = std::make_shared<py_saved_state>();
    s->state = std::make_shared<gil_object>(gil_object{saved[0]});
    s->parameters = saved[1].cast<nanguard::named_tensors>();
    return s;
  }
  void restore(const nanguard::saved_state& state) override {
    py::gil_scoped_acquire gil;
    const auto* s = dynamic_cast<const py_saved_state*>(&state);
    TORCH_INTERNAL_ASSERT(s, "nanguard: the state was not saved by this Python host");
    call("restore")(s->state->object);
  }
  // Python's begin_traced_run() returns the callable that ends it.
  std::function<void()> begin_traced_run() override {
    py::gil_scoped_acquire gil;
    auto end = std::make_shared<gil_object>(gil_object{call("begin_traced_run")()});
    return [end] {
      py::gil_scoped_acquire gil;
      end->object();
    };
  }
  // Python's bisect_compiled(step_finite) runs the step; without the GIL,
  // as the guard's own step does (a backward on a device thread may need it).
  std::string bisect_compiled(const std::function<bool()>& step_finite) override {
    py::gil_scoped_acquire gil;
    const py::function f = py::get_override(static_cast<const nanguard::training_host*>(this), "bisect_compiled");
    if (!f) return {};
    const py::cpp_function run([&step_finite] { return step_finite(); }, nanguard::python::without_gil());
    return nanguard::python::interruptible([&] { return f(run).cast<std::string>(); });
  }

 private:
  py::function call(const char* name) {
    py::function f = py::get_override(static_cast<const nanguard::training_host*>(this), name);
    TORCH_CHECK_NOT_IMPLEMENTED(f, "nanguard: the training host does not implement ", name, "()");
    return f;
  }
};

/// The names of `values` (to_string of each), as a tuple.
template <typename E, size_t N>
py::tuple names_of(const E (&values)[N]) {
  py::tuple names(N);
  for (size_t i = 0; i < N; ++i) names[i] = py::str(nanguard::to_string(values[i]));
  return names;
}

/// A run_summary as a dict (nanguard.Guard.summary()), its line as "text".
py::dict summary_dict(const nanguard::run_summary& s) {
  py::dict d;
  d["steps"] = s.steps;
  d["not_taken"] = s.not_taken;
  d["rolled_back"] = s.rolled_back;
  d["transient_faults"] = s.transient_faults;
  d["last_bad_step"] = s.last_bad_step;
  d["last_cause"] = s.last_cause;
  d["last_rollback_to"] = s.last_rollback_to;
  d["ended_on_snapshot"] = s.ended_on_snapshot;
  d["initial_step"] = s.initial_step;
  d["aborted"] = s.aborted;
  d["first_step"] = s.first_step;
  d["first_loss"] = s.first_loss;
  d["final_step"] = s.final_step;
  d["final_loss"] = s.final_loss;
  d["loss_scale"] = s.loss_scale;
  d["lr"] = s.lr;
  d["first_lr"] = s.first_lr;
  d["auto_fix"] = s.auto_fix;
  d["auto_fix_since"] = s.auto_fix_since;
  d["status"] = nanguard::run_status(s);
  d["text"] = nanguard::to_string(s);
  return d;
}

}  // namespace

namespace nanguard::python {

/// One option of nanguard.Guard, a row of GUARD_OPTION_TABLE: the one
/// place where the Python Guard's options are written. Guard's signature
/// spells them (for type checkers; a test checks it against the table), its
/// docstring lists their docs, its checks convert each by its type, and
/// GuardOptions(**fields) takes those with a field.
struct guard_option {
  /// The keyword of nanguard.Guard.
  std::string name;
  /// Its annotation in Guard's signature (what python/nanguard/_options.py converts by).
  std::string type;
  /// Its default: the C++ guard_options' (read through the field) unless the row says one.
  py::object default_value;
  /// What it does, for Guard's docstring.
  std::string doc;
  /// The GuardOptions property it sets ("": the Python Guard uses it itself).
  std::string field;
};

/// GuardOptions' properties and GUARD_OPTION_TABLE's rows, written together.
class guard_option_table {
 public:
  explicit guard_option_table(py::class_<nanguard::guard_options>& cls) : cls_(cls) {}

  /// A row whose field is the GuardOptions property `field`, its default
  /// that of guard_options() (or `python_default` where Python's differs).
  guard_option_table& row(const char* name, const char* type, const char* field, const char* doc,
                          py::object python_default = {}) {
    TORCH_INTERNAL_ASSERT(py::hasattr(cls_, field), "nanguard: GuardOptions has no property ", field);
    if (!python_default) python_default = py::cast(nanguard::guard_options()).attr(field);
    rows_.push_back({name, type, std::move(python_default), doc, field});
    return *this;
  }
  /// A row the Python Guard uses itself (no field), its default `python_default`.
  guard_option_table& python_row(const char* name, const char* type, py::object python_default, const char* doc) {
    rows_.push_back({name, type, std::move(python_default), doc, ""});
    return *this;
  }
  py::tuple rows() const { return py::tuple(py::cast(rows_)); }

 private:
  py::class_<nanguard::guard_options>& cls_;
  std::vector<guard_option> rows_;
};

/// A read-write property `name` of a guard_options field (a TORCH_ARG).
#define NANGUARD_GUARD_OPTION(cls, name)                                                                    \
  cls.def_property(                                                                                        \
      #name, [](const nanguard::guard_options& o) { return o.name(); },                                    \
      [](nanguard::guard_options& o, std::decay_t<decltype(std::declval<const nanguard::guard_options&>().name())> v) { \
        o.name(std::move(v));                                                                              \
      })

/// A read-write property `name` of an enum guard_options field, by its name
/// (to_string, and `from_string` for the setter, which names the valid ones).
#define NANGUARD_GUARD_ENUM_OPTION(cls, name, from_string)                                            \
  cls.def_property(                                                                                  \
      #name, [](const nanguard::guard_options& o) { return std::string(nanguard::to_string(o.name())); }, \
      [](nanguard::guard_options& o, const std::string& value) { o.name(from_string(value)); })

/// GuardOptions: nanguard::guard_options, one typed property per option (a
/// misspelled property is an AttributeError, a wrong type a TypeError).
py::class_<nanguard::guard_options> bind_guard_options_class(py::module_& m) {
  py::class_<nanguard::guard_options> o(m, "GuardOptions", "nanguard::guard_options (see nanguard.Guard).");
  // GuardOptions(max_norm=1.0, ...): each keyword sets the property of its name.
  o.def(py::init([](const py::kwargs& fields) {
          nanguard::guard_options options;
          const py::object self = py::cast(&options, py::return_value_policy::reference);
          for (const auto& [name, value] : fields) {
            const auto key = name.cast<std::string>();
            if (key.rfind('_', 0) == 0 || !py::hasattr(py::type::of(self), key.c_str()))
              throw py::type_error("nanguard.GuardOptions: no option '" + key + "'");
            self.attr(key.c_str()) = value;
          }
          return options;
        }),
        "GuardOptions(**fields): guard_options() with each keyword's property set.");
  NANGUARD_GUARD_ENUM_OPTION(o, policy, nanguard::policy_from_string);
  NANGUARD_GUARD_OPTION(o, max_norm);
  NANGUARD_GUARD_OPTION(o, clip_value);
  NANGUARD_GUARD_OPTION(o, replay);
  NANGUARD_GUARD_OPTION(o, verify_remedies);
  NANGUARD_GUARD_OPTION(o, auto_fix);
  NANGUARD_GUARD_OPTION(o, log_top_norms);
  NANGUARD_GUARD_OPTION(o, event_log);
  NANGUARD_GUARD_OPTION(o, bundle_dir);
  NANGUARD_GUARD_OPTION(o, bundle_tags);
  // The front end a finding's remedy is written for ("python", "lightning", ...).
  NANGUARD_GUARD_ENUM_OPTION(o, front_end, nanguard::front_end_from_string);
  NANGUARD_GUARD_OPTION(o, snapshot_every);
  NANGUARD_GUARD_OPTION(o, snapshot_keep);
  NANGUARD_GUARD_OPTION(o, snapshot_memory_mb);
  NANGUARD_GUARD_OPTION(o, rollback_lr_factor);
  NANGUARD_GUARD_OPTION(o, max_bad_steps);
  NANGUARD_GUARD_OPTION(o, max_bad_fraction);
  NANGUARD_GUARD_OPTION(o, spike_rollback_z);
  NANGUARD_GUARD_OPTION(o, verbose);
  NANGUARD_GUARD_OPTION(o, distributed);
  NANGUARD_GUARD_OPTION(o, trace_every_step);
  NANGUARD_GUARD_OPTION(o, replay_spikes);
  NANGUARD_GUARD_OPTION(o, audit_every);
  // The spike window also bounds the samples a spike needs (10 at most).
  o.def_property(
      "spike_window", [](const nanguard::guard_options& g) { return g.spikes().window(); },
      [](nanguard::guard_options& g, int64_t window) {
        g.spikes().window(window).min_samples(std::min<int64_t>(10, window));
      });
  o.def_property(
      "spike_threshold", [](const nanguard::guard_options& g) { return g.spikes().threshold(); },
      [](nanguard::guard_options& g, double threshold) { g.spikes().threshold(threshold); });
  // The scaler and the schedule as the LossScaler and WarmupCosine that hold their options (None: off).
  o.def_property(
      "scaler",
      [](const nanguard::guard_options& g) {
        return g.scaler().enabled() ? std::optional(nanguard::loss_scaler(g.scaler())) : std::nullopt;
      },
      [](nanguard::guard_options& g, const std::optional<nanguard::loss_scaler>& s) {
        g.scaler(s ? s->options() : nanguard::loss_scaler_options().enabled(false));
      });
  o.def_property(
      "schedule",
      [](const nanguard::guard_options& g) {
        return g.schedule() ? std::optional(nanguard::warmup_cosine(*g.schedule())) : std::nullopt;
      },
      [](nanguard::guard_options& g, const std::optional<nanguard::warmup_cosine>& s) {
        g.schedule(s ? std::optional(s->options()) : std::nullopt);
      });
  return o;
}

/// GUARD_OPTION_TABLE: the options of nanguard.Guard, in its signature's
/// order. The defaults are the C++ guard_options' but where Python's differ
/// (None: no file; a dict or a bool for an options struct).
py::tuple guard_option_rows(py::class_<nanguard::guard_options>& o) {
  return guard_option_table(o)
      .row("policy", "Policy", "policy",
           "what a bad step gets: ``\"auto\"`` (the action for the diagnosed cause: bad data is skipped and its "
           "batch quarantined, a divergence or an overflow rolls back, a loss-scale overflow backs off, another "
           "cause is skipped; docs/guard.md's decision table), ``\"skip\"`` (drop it; an enabled loss scaler still "
           "backs off), ``\"backoff\"`` (drop it and back off the loss scale), ``\"rollback\"`` (restore the last "
           "snapshot of model and optimizer and multiply the LR by ``rollback_lr_factor``) or ``\"abort\"`` (write "
           "a repro bundle to ``bundle_dir``, if set, and raise :class:`NonFiniteError`, whose ``result`` is the "
           "step's :class:`StepResult`).")
      .row("max_norm", "float", "max_norm", "clip the global gradient norm to this (0: no clipping).")
      .row("clip_value", "float", "clip_value", "clamp gradient elements to ±clip_value after (0: off).")
      .row("loss_scale", "Union[bool, LossScaleOptions]", "scaler",
           "False (off), True (GradScaler's defaults) or a dict of ``LossScaler`` options (``init_scale``, "
           "``growth_factor``, ...).",
           py::bool_(false))
      .row("replay", "bool", "replay", "replay a bad step under the tracer to name the op.")
      .row("trace_every_step", "bool", "trace_every_step",
           "trace every step's forward and backward instead (the cost of :func:`nanguard.trace` on every step): "
           "a bad step's findings come from the step itself.")
      .row("replay_spikes", "bool", "replay_spikes",
           "a finite step whose loss or grad norm spiked runs again from the same state and the two runs' "
           "signatures are compared: when they differ a third run decides, and a transient fault's step is taken "
           "as the agreeing runs computed it (:attr:`StepResult.fault` \"transient\"); one process.")
      .row("audit_every", "int", "audit_every",
           "every this many steps (0: never) a finite step runs again and the runs' signatures are compared, as "
           "for a spike: corruption too small to spike, for one more forward/backward per audited step.")
      .row("verify_remedies", "bool", "verify_remedies",
           "after a replay names the op, replay the bad step again with its diagnosis's remedy applied (inside "
           "the replay only: an eps on a zero denominator, a clamp, the op in float32, a safe softmax, a lower "
           "loss scale, the batch without its NaN/Inf rows, a cut LR from the last calm snapshot) and record on "
           "the finding whether it kept the step finite (:attr:`Finding.remedy_checks`, "
           ":attr:`Finding.verified_remedy`): one to four replays per replayed bad step (under skip, backoff and "
           "abort the guard keeps the initial weights for the LR cut's check).")
      .row("auto_fix", "bool", "auto_fix",
           "keep the first verified op rewrite (a safe softmax, an eps, a clamp, an op in float32) in force for "
           "the rest of the run: every later warning and :meth:`summary` (``auto_fix``, ``auto_fix_since``) say "
           "so. It changes the model's math from that step on and every op passes its dispatcher hook: make the "
           "remedy a change to the model's code. Needs ``verify_remedies``.")
      .row("event_log", "Optional[PathLike]", "event_log",
           "a JSONL file, one C++ step event per step (``nanguard report`` and :func:`nanguard.report` turn it "
           "into HTML).",
           py::none())
      .row("snapshot_every", "int", "snapshot_every",
           "rollback and auto: snapshot every this many steps (auto: less often when a snapshot costs more than "
           "0.2% of the steps between), before the optimizer steps on parameters just checked finite.")
      .row("snapshot_keep", "int", "snapshot_keep",
           "rollback and auto: the newest snapshots kept, and as many older ones, one per 10 x snapshot_every "
           "steps.")
      .row("snapshot_memory_mb", "float", "snapshot_memory_mb",
           "rollback and auto: the megabytes of memory the snapshots may hold together (0: a quarter of this "
           "machine's); the oldest go first, and one larger than the budget is not taken (a warning says so, and "
           "a rollback without a snapshot skips).")
      .row("rollback_lr_factor", "float", "rollback_lr_factor",
           "rollback and auto: a rollback multiplies the LR by this, the next one before the run is calm again by "
           "its square, then its cube, ...; a rollback for bad data keeps the LR.")
      .row("spike_rollback_z", "float", "spike_rollback_z",
           "auto: a loss spike of at least this robust z-score (and 10x the median loss before) on 3 steps in a "
           "row rolls back before the NaN (0: off, and so is the rollback of a loss over 1000x the run's best "
           "under auto and rollback).")
      .row("max_bad_steps", "int", "max_bad_steps", "aborts after that many bad steps in a row (0: never).")
      .row("max_bad_fraction", "float", "max_bad_fraction",
           "aborts when more than this fraction of the last 100 steps (once there are 20) were bad (1: never).")
      .row("bundle_dir", "Optional[PathLike]", "bundle_dir",
           "where an abort writes its bundle (``nanguard inspect`` and :func:`nanguard.inspect` read it); its "
           "batch is the tensors passed to :meth:`step` as arguments.",
           py::none())
      .row("spike_window", "int", "spike_window", "steps of loss and grad-norm history a spike is judged against.")
      .row("spike_threshold", "float", "spike_threshold", "a z-score above this is a spike.")
      .row("bundle_tags", "Optional[Mapping[str, object]]", "bundle_tags",
           "name -> value tags a bundle carries, e.g. ``{\"task\": \"classify\"}`` for ``nanguard replay BUNDLE "
           "--model scripted.pt``.",
           py::none())
      .row("log_top_norms", "int", "log_top_norms",
           "each event lists this many of the largest per-parameter gradient norms.")
      .row("schedule", "Union[_nanguard.WarmupCosine, ScheduleOptions, None]", "schedule",
           "a :class:`WarmupCosine` (or a dict of its arguments) the guard applies to every param group at the "
           "start of each step, times the product of the rollback factors.")
      .python_row("lr_scheduler", "Union[LRScheduler, ReduceLROnPlateau, Sequence[Any], None]", py::none(),
                  "a torch LR scheduler (or a list of them) the loop steps: a rollback lowers what it computes the "
                  "LR from (its base LRs; OneCycleLR's and CyclicLR's bounds) by the rollback factor too, or its "
                  "next step would undo the rollback's lower LR (``lr_schedulers`` holds them).")
      .python_row("tensorboard", "Union[PathLike, SummaryWriter, StepLogger, None]", py::none(),
                  "a log directory, a ``SummaryWriter`` or a :class:`nanguard.tensorboard.StepLogger`: every "
                  "step's loss, grad norm, per-layer norms, loss scale, LR, skips and findings go to TensorBoard "
                  "too.")
      .python_row("distributed", "Union[bool, ProcessGroup, _nanguard.Distributed, None]", py::none(),
                  "True (torch.distributed's default process group), a ``ProcessGroup`` or a "
                  ":class:`nanguard.Distributed`: data parallel on an unwrapped model: the guard averages the "
                  "gradients over the ranks, one small all-reduce a step makes every rank take the same decision, "
                  "and every rank's result names the ranks that saw the NaN/Inf (``nonfinite_ranks``).")
      .python_row("verbose", "bool", py::bool_(true),
                  "every step the optimizer does not take is a :class:`NanGuardWarning` naming the op, its cause, "
                  "what the guard did and the remedy (the same failure again: a short \"again (3rd time)\" line), "
                  "and :meth:`close` warns the run's summary (:meth:`summary`) when there was one; distributed, "
                  "rank 0 warns. False: silent (the results, the event log and :meth:`summary` still have it "
                  "all).")
      .rows();
}

/// GuardOptions, GuardOption (a row) and GUARD_OPTION_TABLE.
void bind_guard_options(py::module_& m) {
  py::class_<nanguard::guard_options> o = bind_guard_options_class(m);
  py::class_<guard_option>(m, "GuardOption", "One option of nanguard.Guard (GUARD_OPTION_TABLE).")
      .def_readonly("name", &guard_option::name, "The keyword of nanguard.Guard.")
      .def_readonly("type", &guard_option::type, "Its annotation in Guard's signature.")
      .def_readonly("default", &guard_option::default_value, "Its default.")
      .def_readonly("doc", &guard_option::doc, "What it does (Guard's docstring).")
      .def_readonly("field", &guard_option::field,
                    "The GuardOptions property it sets (\"\": the Python Guard uses it itself).")
      .def("__repr__", [](const guard_option& r) {
        return "GuardOption(" + r.name + ": " + r.type + " = " + py::repr(r.default_value).cast<std::string>() + ")";
      });
  m.attr("GUARD_OPTION_TABLE") = guard_option_rows(o);
}
#undef NANGUARD_GUARD_OPTION
#undef NANGUARD_GUARD_ENUM_OPTION

/// The guard: its enums' names, TrainingHost (subclassed in Python) and GuardCore.
void bind_guard(py::module_& m) {
  // The names of the guard's enums, from their one to_string: what Python
  // checks and compares with (a StepResult keeps the strings).
  m.attr("POLICIES") = names_of(nanguard::all_policies);
  m.attr("ACTIONS") = names_of(nanguard::all_actions);
  m.attr("VERDICTS") = names_of(nanguard::all_verdicts);
  bind_guard_options(m);
  m.def("cause_code", [](const std::string& name) { return static_cast<int>(nanguard::cause_from_string(name)) + 1; },
        py::arg("name"),
        "1 + the position of cause `name` in nanguard::cause (unclassified: 1): the number the framework "
        "callbacks log as nanguard/last_cause. A ValueError for another name.");
  m.def("policy_from_string", [](const std::string& name) { return nanguard::to_string(nanguard::policy_from_string(name)); },
        py::arg("name"), "`name` when it names a policy; else a ValueError listing the policies.");
  // nanguard.Guard drives the C++ guard's step through a training_host that
  // Python implements: one step core for every front end.
  py::class_<nanguard::training_host, py_training_host, std::shared_ptr<nanguard::training_host>>(
      m, "TrainingHost", "nanguard::training_host: subclass it to drive the guard from Python.")
      .def(py::init<>());
  py::class_<nanguard::guard>(m, "GuardCore", "nanguard::guard over a Python training host.")
      .def(py::init([](std::shared_ptr<nanguard::training_host> host, const nanguard::guard_options& options) {
             return std::make_unique<nanguard::guard>(std::move(host), options);
           }),
           py::arg("host"), py::arg("options"), py::keep_alive<1, 2>())
      .def("step_accumulated",
           [](nanguard::guard& g, const nanguard::guard::micro_batches& batches,
              const std::function<at::Tensor(size_t, const std::vector<at::Tensor>&)>& forward,
              std::vector<std::string> names) {
             g.set_batch_names(std::move(names));
             // forward(i, tensors): the loss of micro-batch i (an element of
             // `batches`, found by reference), or of another batch (the batch
             // without its NaN/Inf rows, another rank's micro-batch) put
             // into the first micro-batch's call.
             const nanguard::step_fn fn = [&](const std::vector<at::Tensor>& batch) {
               const std::less<const void*> before;
               const bool own = !before(&batch, batches.data()) && before(&batch, batches.data() + batches.size());
               const size_t i = own ? static_cast<size_t>(&batch - batches.data()) : 0;
               return interruptible([&] { return forward(i, batch); });
             };
             return g.step_accumulated(batches, fn);
           },
           py::arg("micro_batches"), py::arg("forward"), py::arg("names"), without_gil(),
           "One guarded step over the micro-batches (their tensors, named by `names` in findings); forward(i) is "
           "the loss of the i-th. Returns its StepEvent.")
      .def("begin_step", &nanguard::guard::begin_step, py::arg("number") = py::none(),
           "Begins a step a framework runs, numbered `number` (its step counter; None: one above the last).")
      .def(
          "inject", [](nanguard::guard& g, const std::string& spec) { g.inject(nanguard::fault_spec_from_string(spec)); },
          py::arg("spec"), "Plants the fault `spec` (nanguard::fault_spec_from_string's text) in the guard's steps.")
      .def("set_sample_indices", &nanguard::guard::set_sample_indices, py::arg("tensor"), py::arg("indices"),
           "The dataset index of each row of batch tensor `tensor` in the next step (Finding.dataset_index).")
      .def("cancel_step", &nanguard::guard::cancel_step)
      .def("check",
           [](nanguard::guard& g, const at::Tensor& loss, const nanguard::step_fn& replay,
              const std::vector<at::Tensor>& batch, std::vector<std::string> names) {
             g.set_batch_names(std::move(names));
             // Python's replay() runs the framework's own batch whatever it is
             // given: another batch (a remedy check's batch without its
             // NaN/Inf rows) it cannot run, so that check is not checkable.
             nanguard::step_fn fn;
             if (replay)
               fn = [&](const std::vector<at::Tensor>& b) {
                 const bool own = b.size() == batch.size() &&
                                  std::equal(b.begin(), b.end(), batch.begin(),
                                             [](const at::Tensor& x, const at::Tensor& y) { return x.is_same(y); });
                 TORCH_CHECK_NOT_IMPLEMENTED(own, "nanguard.Guard.check: replay() runs the step's own batch only, "
                                                  "not another batch (the batch without its NaN/Inf rows)");
                 return interruptible([&] { return replay(b); });
               };
             return g.check(loss, fn, batch);
           },
           py::arg("loss"), py::arg("replay"), py::arg("batch"), py::arg("names"),
           without_gil(),
           "Checks a step a framework ran (the batch's tensors named by `names` in findings); returns its "
           "StepEvent.")
      .def("last_event", [](const nanguard::guard& g) { return g.last_event(); },
           "The last step's StepEvent (after an abort: its bundle).")
      .def_property_readonly("last_warning", [](const nanguard::guard& g) { return g.narrator().last_warning(); },
                             "The last step's warning line (\"\" when the optimizer took it).")
      .def("summary", [](const nanguard::guard& g) { return summary_dict(g.narrator().summary()); },
           "What the run did so far (nanguard::run_summary), its line as \"text\".")
      .def_property_readonly("steps", &nanguard::guard::steps)
      .def_property_readonly("skipped", &nanguard::guard::skipped)
      .def_property_readonly("rollbacks", &nanguard::guard::rollbacks)
      .def_property_readonly("lr_factor", &nanguard::guard::lr_factor)
      .def_property_readonly("scaler", &nanguard::guard::scaler, py::return_value_policy::reference_internal)
      .def_property_readonly("sentinel", &nanguard::guard::sentinel, py::return_value_policy::reference_internal);
}

/// Distributed: the consensus over a torch.distributed process group.
void bind_distributed(py::module_& m) {
  py::class_<nanguard::distributed, std::shared_ptr<nanguard::distributed>>(
      m, "Distributed",
      "nanguard::distributed over a torch.distributed process group: the guard averages the gradients and "
      "every rank takes the same decision each step.")
      .def(py::init([](c10::intrusive_ptr<c10d::ProcessGroup> pg, bool average_gradients, const std::string& backward) {
             static const char* const collectives[] = {"none", "all_reduce", "reduce_scatter"};
             return std::make_shared<nanguard::distributed>(
                 std::move(pg), nanguard::distributed_options().average_gradients(average_gradients).backward(
                                    enum_of<nanguard::backward_collective>(backward, collectives,
                                                                           "nanguard.Distributed: backward")));
           }),
           py::arg("process_group"), py::arg("average_gradients") = true, py::arg("backward") = "none",
           "backward: the collective the model's own backward reduces the gradients with: \"none\" (the guard "
           "averages them), \"all_reduce\" (DistributedDataParallel) or \"reduce_scatter\" (FSDP2)")
      .def_property_readonly("backward",
                             [](const nanguard::distributed& d) {
                               std::string name = nanguard::to_string(d.options().backward());
                               std::replace(name.begin(), name.end(), '-', '_');
                               return name;
                             })
      .def_property_readonly("rank", &nanguard::distributed::rank)
      .def_property_readonly("world_size", &nanguard::distributed::world_size);
}

}  // namespace nanguard::python
