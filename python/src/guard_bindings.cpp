// guard_bindings.cpp — the guard over a Python training host, and its distributed consensus.
#include "bindings.h"

#include <nanguard/distributed.h>
#include <nanguard/events.h>
#include <nanguard/guard.h>
#include <nanguard/policy.h>
#include <nanguard/run_summary.h>
#include <nanguard/training_host.h>

#include <algorithm>

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
  d["last_bad_step"] = s.last_bad_step;
  d["last_cause"] = s.last_cause;
  d["last_rollback_to"] = s.last_rollback_to;
  d["ended_on_snapshot"] = s.ended_on_snapshot;
  d["aborted"] = s.aborted;
  d["first_step"] = s.first_step;
  d["first_loss"] = s.first_loss;
  d["final_step"] = s.final_step;
  d["final_loss"] = s.final_loss;
  d["loss_scale"] = s.loss_scale;
  d["lr"] = s.lr;
  d["text"] = nanguard::to_string(s);
  return d;
}

}  // namespace

namespace nanguard::python {

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

/// GuardOptions: nanguard::guard_options, one typed property per option
/// (python/nanguard/_guard.py fills it from Guard's keyword arguments; a
/// misspelled property is an AttributeError, a wrong type a TypeError).
void bind_guard_options(py::module_& m) {
  py::class_<nanguard::guard_options> o(m, "GuardOptions", "nanguard::guard_options (see nanguard.Guard).");
  o.def(py::init<>());
  NANGUARD_GUARD_ENUM_OPTION(o, policy, nanguard::policy_from_string);
  NANGUARD_GUARD_OPTION(o, max_norm);
  NANGUARD_GUARD_OPTION(o, clip_value);
  NANGUARD_GUARD_OPTION(o, replay);
  NANGUARD_GUARD_OPTION(o, log_top_norms);
  NANGUARD_GUARD_OPTION(o, event_log);
  NANGUARD_GUARD_OPTION(o, bundle_dir);
  NANGUARD_GUARD_OPTION(o, bundle_tags);
  // The front end a finding's remedy is written for ("python", "lightning", ...).
  NANGUARD_GUARD_ENUM_OPTION(o, front_end, nanguard::front_end_from_string);
  NANGUARD_GUARD_OPTION(o, snapshot_every);
  NANGUARD_GUARD_OPTION(o, snapshot_keep);
  NANGUARD_GUARD_OPTION(o, rollback_lr_factor);
  NANGUARD_GUARD_OPTION(o, max_bad_steps);
  NANGUARD_GUARD_OPTION(o, max_bad_fraction);
  NANGUARD_GUARD_OPTION(o, spike_rollback_z);
  NANGUARD_GUARD_OPTION(o, verbose);
  NANGUARD_GUARD_OPTION(o, distributed);
  // A tracer on every step costs what nanguard.trace does: not inside kernels.
  o.def_property(
      "trace_every_step", [](const nanguard::guard_options& g) { return g.trace_every_step(); },
      [](nanguard::guard_options& g, bool on) {
        g.trace_every_step(on).tracer(nanguard::tracer_options().inside_kernels(!on));
      });
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
}
#undef NANGUARD_GUARD_OPTION

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
              const std::function<at::Tensor(size_t)>& forward, std::vector<std::string> names) {
             g.set_batch_names(std::move(names));
             // The guard runs the step on the elements of `batches`, by
             // reference: an element's position is the index of the
             // micro-batch, which Python's forward takes.
             const nanguard::step_fn fn = [&](const std::vector<at::Tensor>& batch) {
               const std::less<const void*> before;
               TORCH_INTERNAL_ASSERT(!before(&batch, batches.data()) && before(&batch, batches.data() + batches.size()),
                                     "nanguard: the guard ran a step on a batch it was not given");
               return interruptible([&] { return forward(static_cast<size_t>(&batch - batches.data())); });
             };
             return g.step_accumulated(batches, fn);
           },
           py::arg("micro_batches"), py::arg("forward"), py::arg("names"), without_gil(),
           "One guarded step over the micro-batches (their tensors, named by `names` in findings); forward(i) is "
           "the loss of the i-th. Returns its StepEvent.")
      .def("begin_step", &nanguard::guard::begin_step)
      .def("cancel_step", &nanguard::guard::cancel_step)
      .def("check",
           [](nanguard::guard& g, const at::Tensor& loss, const nanguard::step_fn& replay,
              const std::vector<at::Tensor>& batch, std::vector<std::string> names) {
             g.set_batch_names(std::move(names));
             nanguard::step_fn fn;
             if (replay) fn = [&](const std::vector<at::Tensor>& b) { return interruptible([&] { return replay(b); }); };
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
