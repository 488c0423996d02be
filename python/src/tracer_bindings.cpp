// tracer_bindings.cpp — the tracer, its findings and the module scopes it names ops by.
#include "bindings.h"

#include <nanguard/diagnosis.h>
#include <nanguard/finding.h>
#include <nanguard/remedy_check.h>
#include <nanguard/scope.h>
#include <nanguard/source_location.h>
#include <nanguard/tracer.h>

#include <torch/nn/module.h>

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

}  // namespace

namespace nanguard::python {

/// Findings (as JSON) to text, and diagnosed again; a remedy check to its line.
void bind_findings(py::module_& m) {
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
  m.def("remedy_check_to_string",
        [](const std::string& remedy, const std::string& applied, const std::string& result, double loss,
           const std::string& detail) {
          return nanguard::to_string(nanguard::remedy_check{nanguard::remedy_kind_from_string(remedy), applied,
                                                            nanguard::check_result_from_string(result), loss,
                                                            detail});
        },
        py::arg("remedy"), py::arg("applied"), py::arg("result"), py::arg("loss"), py::arg("detail"),
        "One remedy check as a line (nanguard::to_string(remedy_check)): \"verified finite: ...\".");
}

/// The module scopes Python opens around forward calls.
void bind_scope(py::module_& m) {
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
}

/// The Tracer: observes every ATen op of its thread. The calls that take
/// its lock release the GIL: a finding reads the Python stack (its source
/// line) under that lock, on the thread that ran the op.
void bind_tracer(py::module_& m) {
  m.def("set_library_paths", &nanguard::set_library_paths, py::arg("directories"),
        "Frames from files under these directories are not the user's code: a finding's source line is the "
        "innermost frame outside them (nanguard::set_library_paths).");
  py::class_<py_tracer>(m, "Tracer", "nanguard::tracer: observes every ATen op of this thread.")
      .def(py::init([](int64_t max_findings, bool capture_backtrace,
                       const std::vector<std::tuple<std::string, std::string, bool, bool, bool>>& allow,
                       bool measure_cost, bool inside_kernels, bool record_sources) {
             nanguard::tracer_options o;
             o.max_findings(max_findings).capture_backtrace(capture_backtrace).measure_cost(measure_cost);
             o.inside_kernels(inside_kernels).record_sources(record_sources);
             std::vector<nanguard::allow_rule> rules;
             for (const auto& [op, module, nan, pos_inf, neg_inf] : allow)
               rules.push_back(nanguard::allow_rule().op(op).module(module).nan(nan).pos_inf(pos_inf).neg_inf(neg_inf));
             o.allow(std::move(rules));
             return std::make_unique<py_tracer>(std::move(o));
           }),
           py::arg("max_findings"), py::arg("capture_backtrace"), py::arg("allow"), py::arg("measure_cost") = false,
           py::arg("inside_kernels") = false, py::arg("record_sources") = false)
      .def("name_parameters", [](py_tracer& t, const std::vector<std::pair<std::string, at::Tensor>>& named) {
        t.get().name_parameters(*mirror_of(named));
      }, py::arg("named_parameters"), "Names parameters (and through them modules) from (name, tensor) pairs.")
      .def("name_tensor", [](py_tracer& t, const at::Tensor& x, const std::string& name) {
        t.get().name_tensor(x, name);
      })
      .def("set_step", [](py_tracer& t, int64_t step) { t.get().set_step(step); }, without_gil())
      .def("keep_known_across_steps", [](py_tracer& t, const std::vector<at::Tensor>& tensors) {
        t.get().keep_known_across_steps(tensors);
      }, py::arg("tensors"), without_gil(), "What the tracer knows of these tensors (an optimizer's state) outlasts the step.")
      .def("judge_by_outputs", [](py_tracer& t, const std::vector<at::Tensor>& outputs) {
        t.get().judge_by_outputs(outputs);
      }, py::arg("outputs"), without_gil(), "The traced model returned these tensors: judges every chain by whether it reaches them.")
      .def("awaits_judgement", [](py_tracer& t) { return t.get().awaits_judgement(); }, without_gil(),
           "False when judge_by_outputs would change nothing (a healthy pass): the outputs need not be collected.")
      .def("found", [](py_tracer& t) { return t.get().found(); }, without_gil())
      .def("findings_json", [](py_tracer& t) {
        std::vector<std::string> out;
        for (const auto& f : t.get().findings()) out.push_back(nanguard::to_json(f));
        return out;
      }, without_gil())
      .def("clear", [](py_tracer& t) { t.get().clear(); }, without_gil())
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
}

}  // namespace nanguard::python
