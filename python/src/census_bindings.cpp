// census_bindings.cpp — the census of tensors: TensorStats, census, check_many.
#include "bindings.h"

#include <nanguard/census.h>
#include <nanguard/nonfinite_record.h>
#include <nanguard/observer_pause.h>
#include <nanguard/tracer.h>

namespace {

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

}  // namespace

namespace nanguard::python {

/// census, has_nonfinite, census_many, check_many, mark_written and their results.
void bind_census(py::module_& m) {
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
}

}  // namespace nanguard::python
