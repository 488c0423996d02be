// bindings.h — what the files of the `_nanguard` extension share: pybind11
// with LibTorch's casters, and one bind_AREA(m) per area (module.cpp calls
// them in order).
#pragma once

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <nanguard/training_host.h>

#include <exception>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace nanguard::python {

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

/// A KeyboardInterrupt or SystemExit raised in Python code the guard runs:
/// the guard lets a nanguard::interrupted through (a replay notes other
/// errors and goes on), and module.cpp's translator raises the original again.
struct python_interrupt : nanguard::interrupted {
  explicit python_interrupt(const py::error_already_set& e) : interrupted(e.what()), error(e) {}
  py::error_already_set error;
};

/// `run()`, its Python interrupts thrown as python_interrupt.
template <class Run>
auto interruptible(const Run& run) -> decltype(run()) {
  try {
    return run();
  } catch (const py::error_already_set& e) {
    py::gil_scoped_acquire gil;
    if (e.matches(PyExc_KeyboardInterrupt) || e.matches(PyExc_SystemExit)) throw python_interrupt(e);
    throw;
  }
}

/// The C++ warnings (TORCH_WARN: the guard's, ATen's) of a call, raised as
/// Python warnings (UserWarning) when it returns: torch's PyWarningHandler
/// over the call, as torch's own bindings do, told when the call throws (it
/// then warns without replacing the error). Without it they are raw log
/// lines on stderr that `warnings` and pytest.warns never see. A pybind11
/// call guard; the bindings use it through without_gil.
class python_warnings {
 public:
  ~python_warnings() noexcept(false) {
    if (std::uncaught_exceptions() > uncaught_before_) handler_.set_in_exception();
  }

 private:
  torch::PyWarningHandler handler_;
  int uncaught_before_ = std::uncaught_exceptions();
};

/// The call guard of every binding that runs nanguard's work: the GIL
/// released while it runs, its warnings raised in Python after (with the GIL
/// held again).
using without_gil = py::call_guard<python_warnings, py::gil_scoped_release>;

/// census_bindings.cpp
void bind_census(py::module_& m);
/// tracer_bindings.cpp
void bind_findings(py::module_& m);
/// tracer_bindings.cpp
void bind_scope(py::module_& m);
/// tracer_bindings.cpp
void bind_tracer(py::module_& m);
/// training_bindings.cpp
void bind_sentinel(py::module_& m);
/// training_bindings.cpp
void bind_schedule(py::module_& m);
/// training_bindings.cpp
void bind_loss_scaler(py::module_& m);
/// events_bindings.cpp
void bind_events(py::module_& m);
/// data_bindings.cpp
void bind_isolation_forest(py::module_& m);
/// data_bindings.cpp
void bind_firewall(py::module_& m);
/// data_bindings.cpp
void bind_csv(py::module_& m);
/// guard_bindings.cpp
void bind_guard(py::module_& m);
/// guard_bindings.cpp
void bind_distributed(py::module_& m);

}  // namespace nanguard::python
