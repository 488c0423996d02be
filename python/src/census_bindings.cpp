// census_bindings.cpp — the census of tensors: TensorStats, census, check_many.
#include "bindings.h"

#include <nanguard/census.h>
#include <nanguard/nonfinite_record.h>
#include <nanguard/observer_pause.h>
#include <nanguard/tracer.h>

#include <tuple>
#include <type_traits>

namespace {

/// The tensor_stats a stats_dict() holds (the fields a shard's census sends to the others).
nanguard::tensor_stats stats_from_dict(const py::dict& d) {
  nanguard::tensor_stats s;
  nanguard::for_each_stats_field([&](const char* name, auto field) {
    using value_type = std::remove_reference_t<decltype(s.*field)>;
    s.*field = static_cast<value_type>(d[name].cast<double>());  // counts may come as floats
  });
  return s;
}

py::dict stats_dict(const nanguard::tensor_stats& s) {
  py::dict d;
  nanguard::for_each_stats_field([&](const char* name, auto field) { d[name] = s.*field; });
  return d;
}

/// The verdict check_many gives for tensors whose counts are `parts`:
/// (nan, pos_inf, neg_inf, first non-finite index, its value) of each.
nanguard::record_verdict verdict_of(const std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, double>>& parts) {
  nanguard::record_verdict v;
  v.tensors = static_cast<int64_t>(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& [nan, pos_inf, neg_inf, index, value] = parts[i];
    v.nan += nan;
    v.pos_inf += pos_inf;
    v.neg_inf += neg_inf;
    if (v.first_tensor < 0 && nan + pos_inf + neg_inf > 0) {
      v.first_tensor = static_cast<int64_t>(i);
      v.first_index = index;
      v.first_value = value;
    }
  }
  return v;
}

}  // namespace

namespace nanguard::python {

/// census, has_nonfinite, census_many, check_many, mark_written and their results.
void bind_census(py::module_& m) {
  py::class_<nanguard::tensor_stats> stats(m, "TensorStats", "One-pass statistics of a tensor (census).");
  nanguard::for_each_stats_field([&](const char* name, auto field) { stats.def_readonly(name, field); });
  stats.def(py::init(&stats_from_dict), py::arg("fields"),
            "The TensorStats whose to_dict() is `fields`, as from_dict (what unpickling calls).");
  stats.def_property_readonly("nonfinite", &nanguard::tensor_stats::nonfinite, "NaN and Inf elements.")
      .def("all_finite", &nanguard::tensor_stats::all_finite, "True when every element is finite.")
      .def("to_dict", &stats_dict, "Every field as a dict.")
      .def_static("from_dict", &stats_from_dict, py::arg("fields"),
                  "The TensorStats whose to_dict() is `fields` (counts may come as floats).")
      // Pickled as TensorStats(its to_dict()): a census crosses to DataLoader
      // workers and other processes, and is saved with the findings that
      // hold it. __reduce__ rather than py::pickle, whose __setstate__ aborts
      // the interpreter under protocols 0 and 1.
      .def("__reduce__", [](const py::object& self) {
        return py::make_tuple(py::type::of(self), py::make_tuple(self.attr("to_dict")()));
      })
      .def("__str__", [](const nanguard::tensor_stats& s) { return nanguard::to_string(s); })
      .def("__repr__", [](const nanguard::tensor_stats& s) {
        return "<nanguard.TensorStats " + nanguard::to_string(s) + ">";
      });
  m.def("census", &nanguard::census, py::arg("tensor"), without_gil(),
        "One vectorised pass: NaN/Inf/zero/subnormal counts, min/max/mean/std, norms, headroom.");
  m.def("merge_census", &nanguard::merge_census, py::arg("parts"),
        "The census of a tensor made of parts (shards) from the census of each; each part's "
        "first_nonfinite_index must index the whole tensor.");
  m.def("has_nonfinite", &nanguard::has_nonfinite, py::arg("tensor"),
        without_gil(), "True when the tensor holds a NaN or an Inf.");
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
        py::arg("tensors"), without_gil(),
        "The census of each tensor; on CUDA many per kernel launch and one host sync for all.");
  m.def("verdict_of", &verdict_of, py::arg("parts"),
        "A RecordVerdict from (nan, pos_inf, neg_inf, first_index, first_value) of each tensor, in order "
        "(check_many of DTensors).");
  m.def("check_many", [](const std::vector<at::Tensor>& xs) { return nanguard::check_many(xs); },
        py::arg("tensors"), without_gil(),
        "Whether any tensor holds a NaN or Inf, and the first that does; on CUDA one host sync for all.");
  m.def("pause_observers", &nanguard::pause_observers,
        "Pauses every nanguard observer on this thread until resume_observers() (torch.compile's compile).");
  m.def("resume_observers", &nanguard::resume_observers, "Ends the latest pause_observers() on this thread.");
  m.def("observers_paused", &nanguard::observers_paused, "True while this thread's observers are paused.");
  m.def("mark_written", &nanguard::mark_written, py::arg("tensor"),
        "Tells tracers the tensor changed outside a recorded op (bumps its version).");
}

}  // namespace nanguard::python
