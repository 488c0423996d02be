/// bindings.cpp — the `_nanguard` extension: nanguard's C++ core for Python.
///
/// Tensors cross as at::Tensor through LibTorch's own pybind11 casters
/// (torch/csrc/utils/pybind.h): no copies. The pure-Python package
/// `nanguard` (python/nanguard) wraps these bindings in Pythonic classes.
#include <nanguard/bundle.h>
#include <nanguard/census.h>
#include <nanguard/distributed.h>
#include <nanguard/clip.h>
#include <nanguard/events.h>
#include <nanguard/finding.h>
#include <nanguard/firewall.h>
#include <nanguard/guard.h>
#include <nanguard/isolation_forest.h>
#include <nanguard/loss_scaler.h>
#include <nanguard/nonfinite_record.h>
#include <nanguard/observer_pause.h>
#include <nanguard/schedule.h>
#include <nanguard/scope.h>
#include <nanguard/sentinel.h>
#include <nanguard/tensorboard.h>
#include <nanguard/tracer.h>
#include <nanguard/training_host.h>
#include <nanguard/version.h>

#include <torch/csrc/utils/pybind.h>
#include <torch/nn/module.h>

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

/// Scopes opened from Python (module forward hooks), innermost last.
std::vector<std::unique_ptr<nanguard::scope>>& python_scopes() {
  thread_local std::vector<std::unique_ptr<nanguard::scope>> scopes;
  return scopes;
}

/// A tree of empty torch::nn::Modules that holds `named` tensors under their
/// dotted names, so tracer::name_parameters names Python parameters (and,
/// through them, the modules that own them) exactly as for a C++ model.
std::shared_ptr<torch::nn::Module> mirror_of(
    const std::vector<std::pair<std::string, at::Tensor>>& named) {
  auto root = std::make_shared<torch::nn::Module>();
  for (const auto& [name, tensor] : named) {
    TORCH_CHECK(tensor.defined(), "nanguard: the parameter '", name, "' is undefined");
    std::shared_ptr<torch::nn::Module> m = root;
    size_t start = 0;
    for (size_t dot; (dot = name.find('.', start)) != std::string::npos; start = dot + 1) {
      const std::string part = name.substr(start, dot - start);
      auto children = m->named_children();
      if (auto* c = children.find(part)) m = *c;
      else m = m->register_module(part, std::make_shared<torch::nn::Module>());
    }
    const std::string leaf = name.substr(start);
    if (!m->named_parameters(/*recurse=*/false).contains(leaf))
      m->register_parameter(leaf, tensor, tensor.requires_grad());
  }
  return root;
}

/// The tracer as Python holds it: closed explicitly (on any thread; see
/// detail/observer_slot.h).
class py_tracer {
 public:
  explicit py_tracer(nanguard::tracer_options o) : t_(std::make_unique<nanguard::tracer>(std::move(o))) {}
  nanguard::tracer& get() {
    TORCH_CHECK(t_, "nanguard: the tracer is closed");
    return *t_;
  }
  void close() { t_.reset(); }
  bool closed() const { return !t_; }

 private:
  std::unique_ptr<nanguard::tracer> t_;
};

/// The tensor_stats a stats_dict() holds (the fields a shard's census sends to the others).
nanguard::tensor_stats stats_from_dict(const py::dict& d) {
  nanguard::tensor_stats s;
  const auto count = [&](const char* k) { return static_cast<int64_t>(d[k].cast<double>()); };
  const auto value = [&](const char* k) { return d[k].cast<double>(); };
  s.numel = count("numel");
  s.nan = count("nan");
  s.pos_inf = count("pos_inf");
  s.neg_inf = count("neg_inf");
  s.finite = count("finite");
  s.zeros = count("zeros");
  s.subnormal = count("subnormal");
  s.min = value("min");
  s.max = value("max");
  s.mean = value("mean");
  s.std = value("std");
  s.l2_norm = value("l2_norm");
  s.absmax = value("absmax");
  s.fp16_overflow = count("fp16_overflow");
  s.fp16_underflow = count("fp16_underflow");
  s.bf16_overflow = count("bf16_overflow");
  s.first_nonfinite_index = count("first_nonfinite_index");
  s.first_nonfinite_value = value("first_nonfinite_value");
  return s;
}

py::dict stats_dict(const nanguard::tensor_stats& s) {
  py::dict d;
  d["numel"] = s.numel;
  d["nan"] = s.nan;
  d["pos_inf"] = s.pos_inf;
  d["neg_inf"] = s.neg_inf;
  d["finite"] = s.finite;
  d["zeros"] = s.zeros;
  d["subnormal"] = s.subnormal;
  d["min"] = s.min;
  d["max"] = s.max;
  d["mean"] = s.mean;
  d["std"] = s.std;
  d["l2_norm"] = s.l2_norm;
  d["absmax"] = s.absmax;
  d["fp16_overflow"] = s.fp16_overflow;
  d["fp16_underflow"] = s.fp16_underflow;
  d["bf16_overflow"] = s.bf16_overflow;
  d["first_nonfinite_index"] = s.first_nonfinite_index;
  d["first_nonfinite_value"] = s.first_nonfinite_value;
  return d;
}

/// The enum value named `name` among `names` (in enum order), or a ValueError
/// that names `what` ("nanguard.Firewall: nonfinite policy") and lists the
/// valid names.
template <typename E, size_t N>
E enum_of(const std::string& name, const char* const (&names)[N], const char* what) {
  for (size_t i = 0; i < N; ++i)
    if (name == names[i]) return static_cast<E>(i);
  std::string valid;
  for (size_t i = 0; i < N; ++i) valid += (i ? ", " : "") + std::string(names[i]);
  throw py::value_error(std::string(what) + ": unknown '" + name + "'; use one of: " + valid);
}

// Names in the order of the enums in firewall.h.
const char* const nonfinite_names[] = {"raise", "drop", "nan_to_num", "impute_median", "ignore"};
const char* const outlier_names[] = {"ignore", "raise", "drop", "clip"};
const char* const rule_names[] = {"quantile_range", "three_sigma", "robust_z"};

py::dict column_report_dict(const nanguard::column_report& c) {
  py::dict d;
  d["nan"] = c.nan;
  d["pos_inf"] = c.pos_inf;
  d["neg_inf"] = c.neg_inf;
  d["outliers"] = c.outliers;
  d["repaired"] = c.repaired;
  d["clipped"] = c.clipped;
  return d;
}

/// The exception a guard's abort raises: its argument is the finding's JSON.
PyObject*& guard_abort_type() {
  static PyObject* type = nullptr;
  return type;
}

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
    TORCH_CHECK(s, "nanguard: the state was not saved by this Python host");
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
    const py::cpp_function run([&step_finite] { return step_finite(); }, py::call_guard<py::gil_scoped_release>());
    return f(run).cast<std::string>();
  }

 private:
  py::function call(const char* name) {
    py::function f = py::get_override(static_cast<const nanguard::training_host*>(this), name);
    TORCH_CHECK(f, "nanguard: the training host does not implement ", name, "()");
    return f;
  }
};

/// The options of a guard as the Python Guard passes them (python/nanguard/_guard.py).
nanguard::guard_options guard_options_of(const py::dict& o) {
  const auto get = [&](const char* key) { return o[key]; };
  static const char* const policies[] = {"skip", "backoff", "rollback", "abort"};
  nanguard::guard_options g;
  g.policy(enum_of<nanguard::policy>(get("policy").cast<std::string>(), policies, "nanguard.Guard: policy"))
      .max_norm(get("max_norm").cast<double>())
      .clip_value(get("clip_value").cast<double>())
      .replay(get("replay").cast<bool>())
      .log_top_norms(get("log_top_norms").cast<int64_t>())
      .event_log(get("event_log").cast<std::string>())
      .bundle_dir(get("bundle_dir").cast<std::string>())
      .bundle_tags(get("bundle_tags").cast<nanguard::bundle_tag_list>())
      .snapshot_every(get("snapshot_every").cast<int64_t>())
      .snapshot_keep(get("snapshot_keep").cast<int64_t>())
      .rollback_lr_factor(get("rollback_lr_factor").cast<double>())
      .max_bad_steps(get("max_bad_steps").cast<int64_t>())
      .spikes(nanguard::spike_options()
                  .window(get("spike_window").cast<int64_t>())
                  .threshold(get("spike_threshold").cast<double>())
                  .min_samples(std::min<int64_t>(10, get("spike_window").cast<int64_t>())));
  // A tracer on every step costs what nanguard.trace does: not inside kernels.
  if (get("trace_every_step").cast<bool>()) g.trace_every_step(true).tracer(nanguard::tracer_options());
  if (!get("scaler").is_none()) g.scaler(get("scaler").cast<nanguard::loss_scaler>().options());
  if (!get("schedule").is_none()) g.schedule(get("schedule").cast<nanguard::warmup_cosine>().options());
  if (!get("distributed").is_none()) g.distributed(get("distributed").cast<std::shared_ptr<nanguard::distributed>>());
  return g;
}

}  // namespace

PYBIND11_MODULE(_nanguard, m) {
  m.doc() = "nanguard's C++ core (census, tracer, scope, sentinel, loss scaler)";
  m.attr("__version__") = NANGUARD_VERSION;
  guard_abort_type() = PyErr_NewException("nanguard._nanguard.GuardAbort", PyExc_RuntimeError, nullptr);
  m.attr("GuardAbort") = py::handle(guard_abort_type());
  // C++ errors as the Python exception of their kind, as torch maps them,
  // with the message only (no C++ backtrace); nanguard's own checks
  // (TORCH_CHECK) refuse values, so a plain c10::Error is a ValueError. Any
  // other std::exception is a RuntimeError (pybind11's default). Files are
  // opened on the Python side (OSError).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const nanguard::nonfinite_error& e) {
      // The guard's abort: nanguard.Guard raises NonFiniteError with the finding.
      PyErr_SetObject(guard_abort_type(), py::str(nanguard::to_json(e.finding())).ptr());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
    } catch (const c10::IndexError& e) {
      PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
    } catch (const c10::NotImplementedError& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    }
  });

  // ------------------------------------------------------------ census
  py::class_<nanguard::tensor_stats>(m, "TensorStats", "One-pass statistics of a tensor (census).")
      .def_readonly("numel", &nanguard::tensor_stats::numel)
      .def_readonly("nan", &nanguard::tensor_stats::nan)
      .def_readonly("pos_inf", &nanguard::tensor_stats::pos_inf)
      .def_readonly("neg_inf", &nanguard::tensor_stats::neg_inf)
      .def_readonly("finite", &nanguard::tensor_stats::finite)
      .def_readonly("zeros", &nanguard::tensor_stats::zeros)
      .def_readonly("subnormal", &nanguard::tensor_stats::subnormal)
      .def_readonly("min", &nanguard::tensor_stats::min)
      .def_readonly("max", &nanguard::tensor_stats::max)
      .def_readonly("mean", &nanguard::tensor_stats::mean)
      .def_readonly("std", &nanguard::tensor_stats::std)
      .def_readonly("l2_norm", &nanguard::tensor_stats::l2_norm)
      .def_readonly("absmax", &nanguard::tensor_stats::absmax)
      .def_readonly("fp16_overflow", &nanguard::tensor_stats::fp16_overflow)
      .def_readonly("fp16_underflow", &nanguard::tensor_stats::fp16_underflow)
      .def_readonly("bf16_overflow", &nanguard::tensor_stats::bf16_overflow)
      .def_readonly("first_nonfinite_index", &nanguard::tensor_stats::first_nonfinite_index)
      .def_readonly("first_nonfinite_value", &nanguard::tensor_stats::first_nonfinite_value)
      .def_property_readonly("nonfinite", &nanguard::tensor_stats::nonfinite, "NaN and Inf elements.")
      .def("all_finite", &nanguard::tensor_stats::all_finite, "True when every element is finite.")
      .def("to_dict", &stats_dict, "Every field as a dict.")
      .def_static("from_dict", &stats_from_dict, py::arg("fields"),
                  "The TensorStats whose to_dict() is `fields` (counts may come as floats).")
      .def("__str__", [](const nanguard::tensor_stats& s) { return nanguard::to_string(s); })
      .def("__repr__", [](const nanguard::tensor_stats& s) {
        return "<nanguard.TensorStats " + nanguard::to_string(s) + ">";
      });
  m.def("census", &nanguard::census, py::arg("tensor"), py::call_guard<py::gil_scoped_release>(),
        "One vectorised pass: NaN/Inf/zero/subnormal counts, min/max/mean/std, norms, headroom.");
  m.def("merge_census", &nanguard::merge_census, py::arg("parts"),
        "The census of a tensor made of parts (shards) from the census of each; each part's "
        "first_nonfinite_index must index the whole tensor.");
  m.def("has_nonfinite", &nanguard::has_nonfinite, py::arg("tensor"),
        py::call_guard<py::gil_scoped_release>(), "True when the tensor holds a NaN or an Inf.");
  py::class_<nanguard::record_verdict>(m, "RecordVerdict",
                                       "What check_many found over a list of tensors (nonfinite_record).")
      .def_readonly("tensors", &nanguard::record_verdict::tensors)
      .def_readonly("nan", &nanguard::record_verdict::nan)
      .def_readonly("pos_inf", &nanguard::record_verdict::pos_inf)
      .def_readonly("neg_inf", &nanguard::record_verdict::neg_inf)
      .def_readonly("first_tensor", &nanguard::record_verdict::first_tensor)
      .def_readonly("first_index", &nanguard::record_verdict::first_index)
      .def_readonly("first_value", &nanguard::record_verdict::first_value)
      .def_property_readonly("nonfinite", &nanguard::record_verdict::nonfinite, "NaN and Inf elements.")
      .def("all_finite", &nanguard::record_verdict::all_finite, "True when every element is finite.")
      .def("__repr__", [](const nanguard::record_verdict& v) {
        return "<nanguard.RecordVerdict tensors=" + std::to_string(v.tensors) + " nonfinite=" +
               std::to_string(v.nonfinite()) + " first=" + std::to_string(v.first_tensor) + "[" +
               std::to_string(v.first_index) + "]>";
      });
  m.def("census_many", [](const std::vector<at::Tensor>& xs) { return nanguard::census_many(xs); },
        py::arg("tensors"), py::call_guard<py::gil_scoped_release>(),
        "The census of each tensor; on CUDA many per kernel launch and one host sync for all.");
  m.def("check_many", [](const std::vector<at::Tensor>& xs) { return nanguard::check_many(xs); },
        py::arg("tensors"), py::call_guard<py::gil_scoped_release>(),
        "Whether any tensor holds a NaN or Inf, and the first that does; on CUDA one host sync for all.");
  m.def("pause_observers", &nanguard::pause_observers,
        "Pauses every nanguard observer on this thread until resume_observers() (torch.compile's compile).");
  m.def("resume_observers", &nanguard::resume_observers, "Ends the latest pause_observers() on this thread.");
  m.def("observers_paused", &nanguard::observers_paused, "True while this thread's observers are paused.");
  m.def("mark_written", &nanguard::mark_written, py::arg("tensor"),
        "Tells tracers the tensor changed outside a recorded op (bumps its version).");

  // ------------------------------------------------------------ findings
  m.def("finding_to_string", [](const std::string& json) {
    return nanguard::to_string(nanguard::finding_from_json(json));
  });
  m.def("finding_to_text", [](const std::string& json) {
    return nanguard::to_text(nanguard::finding_from_json(json));
  });
  m.def("diagnose_finding", [](const std::string& json, std::vector<double> losses, std::vector<double> grad_norms,
                               double lr, double loss_scale, std::vector<std::string> data) {
    nanguard::finding f = nanguard::finding_from_json(json);
    f.diagnosis = nanguard::diagnose(f, {std::move(losses), std::move(grad_norms), lr, loss_scale, std::move(data)});
    return nanguard::to_json(f);
  }, py::arg("finding_json"), py::arg("losses"), py::arg("grad_norms"), py::arg("lr"), py::arg("loss_scale"),
     py::arg("data"), "The finding (JSON) diagnosed again with the steps before it (nanguard::diagnose).");

  // ------------------------------------------------------------ scope
  m.def("scope_push", [](const std::string& name) {
    python_scopes().push_back(std::make_unique<nanguard::scope>(name));
  }, py::arg("name"), "Opens a nanguard::scope named `name` inside the current one (this thread).");
  m.def("scope_pop", []() {
    auto& s = python_scopes();
    TORCH_CHECK(!s.empty(), "nanguard: scope_pop without a matching scope_push");
    s.pop_back();
  }, "Closes the innermost scope opened by scope_push.");
  m.def("scope_depth", []() { return python_scopes().size(); },
        "Scopes opened by scope_push and not yet closed (this thread).");
  m.def("current_scope", []() { return nanguard::current_scope(); },
        "The dotted path of the innermost open scope on this thread.");

  // ------------------------------------------------------------ tracer
  py::class_<py_tracer>(m, "Tracer", "nanguard::tracer: observes every ATen op of this thread.")
      .def(py::init([](int64_t max_findings, bool capture_backtrace,
                       const std::vector<std::tuple<std::string, std::string, bool, bool, bool>>& allow,
                       bool measure_cost, bool inside_kernels) {
             nanguard::tracer_options o;
             o.max_findings(max_findings).capture_backtrace(capture_backtrace).measure_cost(measure_cost);
             o.inside_kernels(inside_kernels);
             std::vector<nanguard::allow_rule> rules;
             for (const auto& [op, module, nan, pos_inf, neg_inf] : allow)
               rules.push_back(nanguard::allow_rule().op(op).module(module).nan(nan).pos_inf(pos_inf).neg_inf(neg_inf));
             o.allow(std::move(rules));
             return std::make_unique<py_tracer>(std::move(o));
           }),
           py::arg("max_findings"), py::arg("capture_backtrace"), py::arg("allow"), py::arg("measure_cost") = false,
           py::arg("inside_kernels") = false)
      .def("name_parameters", [](py_tracer& t, const std::vector<std::pair<std::string, at::Tensor>>& named) {
        t.get().name_parameters(*mirror_of(named));
      }, py::arg("named_parameters"), "Names parameters (and through them modules) from (name, tensor) pairs.")
      .def("name_tensor", [](py_tracer& t, const at::Tensor& x, const std::string& name) {
        t.get().name_tensor(x, name);
      })
      .def("set_step", [](py_tracer& t, int64_t step) { t.get().set_step(step); })
      .def("found", [](py_tracer& t) { return t.get().found(); })
      .def("findings_json", [](py_tracer& t) {
        std::vector<std::string> out;
        for (const auto& f : t.get().findings()) out.push_back(nanguard::to_json(f));
        return out;
      })
      .def("clear", [](py_tracer& t) { t.get().clear(); })
      .def("pause", [](py_tracer& t) { t.get().pause(); })
      .def("resume", [](py_tracer& t) { t.get().resume(); })
      .def("active", [](py_tracer& t) { return t.get().active(); })
      .def("cost", [](py_tracer& t) {
        const nanguard::tracer_cost c = t.get().cost();
        py::list by_op;
        for (const auto& o : c.scans_by_op) by_op.append(py::make_tuple(o.op, o.scans, o.bytes));
        py::dict d;
        d["ops"] = c.ops;
        d["scans"] = c.scans;
        d["scanned_bytes"] = c.scanned_bytes;
        d["seconds"] = c.seconds;
        d["scan_seconds"] = c.scan_seconds;
        d["scans_by_op"] = by_op;
        return d;
      }, "What the tracer cost so far (zeros unless made with measure_cost).")
      .def("close", &py_tracer::close, "Stops observing and frees the tracer.")
      .def_property_readonly("closed", &py_tracer::closed);

  // ------------------------------------------------------------ sentinel
  py::class_<nanguard::grad_report>(m, "GradReport", "What one pass over the gradients found.")
      .def_readonly("total_norm", &nanguard::grad_report::total_norm)
      .def_readonly("nonfinite", &nanguard::grad_report::nonfinite)
      .def_readonly("norms", &nanguard::grad_report::norms)
      .def_readonly("nonfinite_counts", &nanguard::grad_report::nonfinite_counts)
      .def_readonly("first_nonfinite_name", &nanguard::grad_report::first_nonfinite_name)
      .def("finite", &nanguard::grad_report::finite);
  py::class_<nanguard::sentinel>(m, "Sentinel", "nanguard::sentinel: fused check of loss and gradients.")
      .def(py::init([](std::vector<std::pair<std::string, at::Tensor>> named, int64_t window,
                       double threshold, int64_t min_samples) {
             return nanguard::sentinel(std::move(named), nanguard::spike_options()
                                                             .window(window)
                                                             .threshold(threshold)
                                                             .min_samples(min_samples));
           }),
           py::arg("named_parameters"), py::arg("window") = 50, py::arg("threshold") = 8.0,
           py::arg("min_samples") = 10)
      .def("check_loss", [](const nanguard::sentinel& s, const at::Tensor& loss) {
        double v = 0;
        const bool ok = s.check_loss(loss, &v);
        return std::make_pair(ok, v);
      }, py::arg("loss"), "(finite, value) of a one-element loss.")
      .def("inspect_grads", &nanguard::sentinel::inspect_grads, py::arg("inv_scale") = 1.0,
           py::call_guard<py::gil_scoped_release>())
      .def("apply_factor_", &nanguard::sentinel::apply_factor_, py::arg("factor"),
           py::call_guard<py::gil_scoped_release>())
      .def("observe", [](nanguard::sentinel& s, double loss, double norm) {
        std::vector<std::tuple<std::string, double, double>> out;
        for (const auto& sp : s.observe(loss, norm)) out.emplace_back(sp.series, sp.value, sp.z);
        return out;
      }, "Spikes of loss and grad norm as (series, value, z).")
      .def("reset_spikes", &nanguard::sentinel::reset_spikes)
      .def_property_readonly("names", &nanguard::sentinel::names);
  m.def("clip_coefficient", &nanguard::clip_coefficient, py::arg("total_norm"), py::arg("max_norm"));

  // ------------------------------------------------------------ the guard's outputs
  // The Python Guard writes the C++ guard's event schema and bundle format
  // through these, so `nanguard report`, `inspect` and `replay` read its runs.
  py::class_<nanguard::event_log>(m, "EventLog", "nanguard::event_log: the guard's JSONL event log.")
      .def(py::init<const std::string&, bool>(), py::arg("path"), py::arg("truncate") = false)
      .def("write", [](nanguard::event_log& log, const std::string& event_json) {
        log.write(nanguard::step_event_from_json(event_json));
      }, py::arg("event_json"),
           "Writes one step event, given as the JSON of a nanguard::step_event (checked as the reader "
           "checks it), and flushes the line.")
      .def_property_readonly("path", &nanguard::event_log::path);
  // The TensorBoard tags of a step event, from the one list the C++ writer
  // uses (nanguard/tensorboard.h), so Python's StepLogger writes the same.
  m.def("tensorboard_scalars", [](const std::string& event_json) {
    return nanguard::step_scalars(nanguard::step_event_from_json(event_json));
  }, py::arg("event_json"), "[(tag, value)] of one step event (JSON) under nanguard's TensorBoard tags.");
  m.def("tensorboard_text", [](const std::string& event_json) {
    return nanguard::step_text(nanguard::step_event_from_json(event_json));
  }, py::arg("event_json"), "The Markdown of a step event's findings, remedy and note (\"\" for a healthy step).");
  m.def("write_bundle",
        [](const std::string& parent, int64_t step, double lr, double scale, double loss, const std::string& policy,
           const std::string& verdict, const std::string& finding_json, std::vector<at::Tensor> batch,
           at::Tensor rng_state, std::vector<std::pair<std::string, at::Tensor>> parameters,
           std::map<std::string, std::string> tags, std::vector<at::Tensor> cuda_rng_states) {
          nanguard::bundle b;
          b.step = step;
          b.lr = lr;
          b.scale = scale;
          b.loss = loss;
          b.policy = policy;
          b.verdict = verdict;
          if (!finding_json.empty()) b.finding = nanguard::finding_from_json(finding_json);
          b.batch = std::move(batch);
          b.rng_state = std::move(rng_state);
          b.cuda_rng_states = std::move(cuda_rng_states);
          for (auto& [name, value] : parameters) b.parameters.emplace_back(name, value.detach());
          b.tags.assign(tags.begin(), tags.end());
          return nanguard::write_bundle(parent, b);
        },
        py::arg("parent"), py::arg("step"), py::arg("lr"), py::arg("scale"), py::arg("loss"), py::arg("policy"),
        py::arg("verdict"), py::arg("finding_json"), py::arg("batch"), py::arg("rng_state"), py::arg("parameters"),
        py::arg("tags"), py::arg("cuda_rng_states") = std::vector<at::Tensor>{},
        "Writes a repro bundle directory (nanguard::write_bundle) under `parent`; returns its path.");

  // ------------------------------------------------------------ isolation forest
  py::class_<nanguard::isolation_forest>(m, "IsolationForest",
                                         "Isolation forest on a [rows, features] tensor (scikit-learn's scores).")
      .def(py::init([](int64_t n_estimators, int64_t max_samples, double contamination, int64_t seed) {
             // Taken signed: pybind11 answers a uint64_t given -1 with a signature dump.
             if (seed < 0)
               throw py::value_error("nanguard.IsolationForest: seed must be an integer >= 0 but is " +
                                     std::to_string(seed));
             return nanguard::isolation_forest(nanguard::isolation_forest_options()
                                                   .n_estimators(n_estimators)
                                                   .max_samples(max_samples)
                                                   .contamination(contamination)
                                                   .seed(seed));
           }),
           py::arg("n_estimators") = 100, py::arg("max_samples") = 256, py::arg("contamination") = 0.0,
           py::arg("seed") = 0)
      .def("fit", &nanguard::isolation_forest::fit, py::arg("x"), py::return_value_policy::reference_internal,
           py::call_guard<py::gil_scoped_release>(), "Grows the trees on finite x [rows, features]; returns self.")
      .def("score_samples", &nanguard::isolation_forest::score_samples, py::arg("x"),
           py::call_guard<py::gil_scoped_release>(), "Per-row score (float64); lower is more abnormal.")
      .def("decision_function", &nanguard::isolation_forest::decision_function, py::arg("x"),
           py::call_guard<py::gil_scoped_release>(), "score_samples(x) - offset: negative for outliers.")
      .def("predict", &nanguard::isolation_forest::predict, py::arg("x"),
           py::call_guard<py::gil_scoped_release>(), "-1 for outliers, +1 for inliers (int64).")
      .def_property_readonly("offset", &nanguard::isolation_forest::offset)
      .def_property_readonly("fitted", &nanguard::isolation_forest::fitted)
      .def_property_readonly("features", &nanguard::isolation_forest::features);

  // ------------------------------------------------------------ data firewall
  py::class_<nanguard::firewall_report>(m, "FirewallReport", "What the firewall found in a batch and did.")
      .def_readonly("rows_in", &nanguard::firewall_report::rows_in)
      .def_readonly("rows_out", &nanguard::firewall_report::rows_out)
      .def_readonly("dropped_rows", &nanguard::firewall_report::dropped_rows)
      .def_readonly("changed_rows", &nanguard::firewall_report::changed_rows)
      .def_property_readonly("columns", [](const nanguard::firewall_report& r) {
        py::list out;
        for (const auto& c : r.columns) out.append(column_report_dict(c));
        return out;
      }, "Per feature: nan, pos_inf, neg_inf, outliers, repaired, clipped.")
      .def_property_readonly("nonfinite", &nanguard::firewall_report::nonfinite)
      .def_property_readonly("outliers", &nanguard::firewall_report::outliers)
      .def_property_readonly("repaired", &nanguard::firewall_report::repaired)
      .def_property_readonly("clipped", &nanguard::firewall_report::clipped)
      .def("clean", &nanguard::firewall_report::clean, "True when nothing was found.")
      .def("__str__", [](const nanguard::firewall_report& r) { return nanguard::to_string(r); });
  py::class_<nanguard::firewall>(m, "Firewall",
                                 "nanguard::firewall: validate, repair or drop the rows of [batch, features] tensors.")
      .def(py::init([](const std::string& nonfinite, const std::string& outliers, const std::string& rule,
                       double low_quantile, double high_quantile, double sigmas, double robust_z,
                       double nan_value, std::vector<int64_t> label_columns,
                       std::vector<std::string> column_names) {
             return nanguard::firewall(
                 nanguard::firewall_options()
                     .nonfinite(enum_of<nanguard::nonfinite_policy>(nonfinite, nonfinite_names, "nanguard.Firewall: nonfinite policy"))
                     .outliers(enum_of<nanguard::outlier_policy>(outliers, outlier_names, "nanguard.Firewall: outlier policy"))
                     .rule(enum_of<nanguard::outlier_rule>(rule, rule_names, "nanguard.Firewall: outlier rule"))
                     .low_quantile(low_quantile)
                     .high_quantile(high_quantile)
                     .sigmas(sigmas)
                     .robust_z(robust_z)
                     .nan_value(nan_value)
                     .label_columns(std::move(label_columns))
                     .column_names(std::move(column_names)));
           }),
           py::arg("nonfinite") = "raise", py::arg("outliers") = "ignore", py::arg("rule") = "quantile_range",
           py::arg("low_quantile") = 0.001, py::arg("high_quantile") = 0.999, py::arg("sigmas") = 3.0,
           py::arg("robust_z") = 3.5, py::arg("nan_value") = 0.0,
           py::arg("label_columns") = std::vector<int64_t>{}, py::arg("column_names") = std::vector<std::string>{})
      .def("fit", py::overload_cast<const at::Tensor&>(&nanguard::firewall::fit), py::arg("data"),
           py::return_value_policy::reference_internal, py::call_guard<py::gil_scoped_release>(),
           "Fits medians and outlier bounds on data [rows, features]; returns self.")
      .def("apply", [](const nanguard::firewall& fw, const at::Tensor& batch) {
             nanguard::firewall_result r;
             {
               py::gil_scoped_release release;
               r = fw.apply(batch);
             }
             return py::make_tuple(r.batch, r.report);
           }, py::arg("batch"), "(cleaned batch, FirewallReport); raises ValueError under a 'raise' policy.")
      .def_property_readonly("fitted", &nanguard::firewall::fitted)
      .def_property_readonly("lower_bounds", &nanguard::firewall::lower_bounds)
      .def_property_readonly("upper_bounds", &nanguard::firewall::upper_bounds);

  // ------------------------------------------------------------ schedule
  py::class_<nanguard::warmup_cosine>(m, "WarmupCosine",
                                      "nanguard::warmup_cosine: linear warmup, then cosine annealing.")
      .def(py::init([](double base_lr, int64_t warmup_steps, int64_t total_steps, double min_lr) {
             return nanguard::warmup_cosine(nanguard::schedule_options(base_lr)
                                                .warmup_steps(warmup_steps)
                                                .total_steps(total_steps)
                                                .min_lr(min_lr));
           }),
           py::arg("base_lr"), py::arg("warmup_steps") = 0, py::arg("total_steps") = 1000, py::arg("min_lr") = 0.0)
      .def("lr", &nanguard::warmup_cosine::lr, py::arg("step"), "The learning rate at 0-based `step`.");

  // ------------------------------------------------------------ loss scaler
  py::class_<nanguard::loss_scaler>(m, "LossScaler", "nanguard::loss_scaler (GradScaler semantics).")
      .def(py::init([](bool enabled, double init_scale, double growth_factor, double backoff_factor,
                       int64_t growth_interval, int64_t hysteresis, double min_scale, double max_scale) {
             return nanguard::loss_scaler(nanguard::loss_scaler_options()
                                              .enabled(enabled)
                                              .init_scale(init_scale)
                                              .growth_factor(growth_factor)
                                              .backoff_factor(backoff_factor)
                                              .growth_interval(growth_interval)
                                              .hysteresis(hysteresis)
                                              .min_scale(min_scale)
                                              .max_scale(max_scale));
           }),
           py::arg("enabled") = true, py::arg("init_scale") = 65536.0, py::arg("growth_factor") = 2.0,
           py::arg("backoff_factor") = 0.5, py::arg("growth_interval") = 2000, py::arg("hysteresis") = 1,
           py::arg("min_scale") = 1.0, py::arg("max_scale") = 16777216.0)
      .def("scale", &nanguard::loss_scaler::scale)
      .def("get_scale", &nanguard::loss_scaler::get_scale)
      .def("inv_scale", &nanguard::loss_scaler::inv_scale)
      .def("update", &nanguard::loss_scaler::update, py::arg("found_nonfinite"))
      .def("set_scale", &nanguard::loss_scaler::set_scale)
      .def_property_readonly("enabled", &nanguard::loss_scaler::enabled);

  // ------------------------------------------------------------ the guard
  // nanguard.Guard drives the C++ guard's step through a training_host that
  // Python implements: one step core for every front end.
  py::class_<nanguard::training_host, py_training_host, std::shared_ptr<nanguard::training_host>>(
      m, "TrainingHost", "nanguard::training_host: subclass it to drive the guard from Python.")
      .def(py::init<>());
  py::class_<nanguard::guard>(m, "GuardCore", "nanguard::guard over a Python training host.")
      .def(py::init([](std::shared_ptr<nanguard::training_host> host, const py::dict& options) {
             return std::make_unique<nanguard::guard>(std::move(host), guard_options_of(options));
           }),
           py::arg("host"), py::arg("options"), py::keep_alive<1, 2>())
      .def("step_accumulated",
           [](nanguard::guard& g, const nanguard::guard::micro_batches& batches,
              const std::function<at::Tensor(size_t)>& forward) {
             // The guard runs the step on the elements of `batches`, by
             // reference: an element's position is the index of the
             // micro-batch, which Python's forward takes.
             const nanguard::step_fn fn = [&](const std::vector<at::Tensor>& batch) {
               const std::less<const void*> before;
               TORCH_CHECK(!before(&batch, batches.data()) && before(&batch, batches.data() + batches.size()),
                           "nanguard: the guard ran a step on a batch it was not given");
               return forward(static_cast<size_t>(&batch - batches.data()));
             };
             return nanguard::to_json(g.step_accumulated(batches, fn));
           },
           py::arg("micro_batches"), py::arg("forward"), py::call_guard<py::gil_scoped_release>(),
           "One guarded step over the micro-batches (their tensors); forward(i) is the loss of the i-th. "
           "Returns the step event's JSON.")
      .def("begin_step", &nanguard::guard::begin_step)
      .def("check",
           [](nanguard::guard& g, const at::Tensor& loss, const nanguard::step_fn& replay,
              const std::vector<at::Tensor>& batch) { return nanguard::to_json(g.check(loss, replay, batch)); },
           py::arg("loss"), py::arg("replay"), py::arg("batch"), py::call_guard<py::gil_scoped_release>(),
           "Checks a step a framework ran; returns the step event's JSON.")
      .def("last_event", [](const nanguard::guard& g) { return nanguard::to_json(g.last_event()); },
           "The last step's event JSON (after an abort: its bundle).")
      .def_property_readonly("steps", &nanguard::guard::steps)
      .def_property_readonly("skipped", &nanguard::guard::skipped)
      .def_property_readonly("rollbacks", &nanguard::guard::rollbacks)
      .def_property_readonly("lr_factor", &nanguard::guard::lr_factor)
      .def_property_readonly("scaler", &nanguard::guard::scaler, py::return_value_policy::reference_internal)
      .def_property_readonly("sentinel", &nanguard::guard::sentinel, py::return_value_policy::reference_internal);

  // ------------------------------------------------------------ distributed
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
