// module.cpp — the `_nanguard` extension: nanguard's C++ core for Python,
// bound per area as torch/csrc does (bind_census(m), bind_tracer(m), ...:
// bindings.h).
//
// Tensors cross as at::Tensor through LibTorch's own pybind11 casters
// (torch/csrc/utils/pybind.h): no copies. The pure-Python package
// `nanguard` (python/nanguard) wraps these bindings in Pythonic classes.
#include "bindings.h"

#include <nanguard/distributed.h>
#include <nanguard/events.h>
#include <nanguard/finding.h>
#include <nanguard/spelling.h>
#include <nanguard/version.h>

namespace {

/// The exception a guard's abort raises: its argument is the finding's JSON.
PyObject*& guard_abort_type() {
  static PyObject* type = nullptr;
  return type;
}

}  // namespace

PYBIND11_MODULE(_nanguard, m) {
  m.doc() = "nanguard's C++ core (census, tracer, scope, sentinel, loss scaler)";
  m.attr("__version__") = NANGUARD_VERSION;
  // Error messages and a tracer's remedies spell code in Python from now on.
  nanguard::set_message_spelling(nanguard::spelling::python);
  guard_abort_type() = PyErr_NewException("nanguard._nanguard.GuardAbort", PyExc_RuntimeError, nullptr);
  m.attr("GuardAbort") = py::handle(guard_abort_type());
  // C++ errors as the Python exception of their kind, as torch maps them,
  // with the message only (no C++ backtrace); nanguard's own checks
  // (TORCH_CHECK) refuse values, so a plain c10::Error is a ValueError. Any
  // other std::exception is a RuntimeError (pybind11's default). Files are
  // opened on the Python side (OSError), and the event log's errors are OSError too.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (nanguard::python::python_interrupt& e) {
      e.error.restore();  // the KeyboardInterrupt or SystemExit itself
    } catch (python_error& e) {
      e.restore();  // a C++ warning a warnings filter made an error (python_warnings)
    } catch (const nanguard::nonfinite_error& e) {
      // The guard's abort: nanguard.Guard raises NonFiniteError with the finding.
      PyErr_SetObject(guard_abort_type(), py::str(nanguard::to_json(e.finding())).ptr());
    } catch (const nanguard::event_log_error& e) {
      PyErr_SetString(PyExc_OSError, e.what_without_backtrace());  // a file error (a full disk)
    } catch (const nanguard::rank_failure& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());  // another rank died or hangs
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

  using namespace nanguard::python;
  bind_census(m);
  bind_findings(m);
  bind_scope(m);
  bind_tracer(m);
  bind_sentinel(m);
  bind_schedule(m);
  bind_loss_scaler(m);
  bind_events(m);
  bind_isolation_forest(m);
  bind_firewall(m);
  bind_distributed(m);  // before the guard, whose GuardOptions.distributed names its type
  bind_csv(m);
  bind_guard(m);
}
