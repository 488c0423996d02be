// events_bindings.cpp — the guard's outputs: its JSONL event log and TensorBoard tags.
#include "bindings.h"

#include <nanguard/events.h>
#include <nanguard/step_signature.h>
#include <nanguard/tensorboard.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace nanguard::python {

/// StepEvent, the EventLog and a step event's TensorBoard scalars and text.
void bind_events(py::module_& m) {
  // What the guard's step returns to Python: nanguard.StepResult reads its
  // fields as they are (no JSON between C++ and Python on every step);
  // to_json() is the event log's line, for StepResult.to_dict().
  using nanguard::step_event;
  py::class_<step_event>(m, "StepEvent", "nanguard::step_event: what one guarded step did (nanguard.StepResult).")
      .def(py::init(&nanguard::step_event_from_json), py::arg("line"),
           "The event of an event log's line (its to_json(); what unpickling calls).")
      .def_readonly("step", &step_event::step)
      .def_readonly("loss", &step_event::loss)
      .def_readonly("grad_norm", &step_event::grad_norm)
      .def_readonly("clip_coef", &step_event::clip_coef)
      .def_readonly("scale", &step_event::scale)
      .def_readonly("lr", &step_event::lr)
      .def_readonly("skipped", &step_event::skipped)
      .def_property_readonly("action", [](const step_event& e) { return nanguard::to_string(e.action); })
      .def_readonly("reason", &step_event::reason)
      .def_property_readonly(
          "spikes",
          [](const step_event& e) {
            std::vector<std::tuple<std::string, double, double>> spikes;
            for (const auto& s : e.spikes) spikes.emplace_back(s.series, s.value, s.z);
            return spikes;
          },
          "[(series, value, z)]")
      .def_property_readonly(
          "nonfinite_params",
          [](const step_event& e) {
            std::vector<std::pair<std::string, int64_t>> bad;
            for (const auto& b : e.nonfinite_params) bad.emplace_back(b.name, b.nonfinite);
            return bad;
          },
          "[(name, NaN/Inf count)]")
      .def_readonly("top_norms", &step_event::top_norms, "[(name, norm)], largest first")
      .def_readonly("rank", &step_event::rank)
      .def_readonly("nonfinite_ranks", &step_event::nonfinite_ranks)
      .def_property_readonly("verdict", [](const step_event& e) { return nanguard::to_string(e.verdict); },
                             "The replay's verdict (\"\": no replay).")
      .def_property_readonly("fault", [](const step_event& e) { return nanguard::to_string(e.fault); },
                             "Hardware or software: data, model, compiler, transient, persistent (\"\": not told).")
      .def_property_readonly("signature", [](const step_event& e) { return nanguard::signature_text(e.signature); },
                             "The step's fingerprint, 16 hex digits (\"\": not measured).")
      .def_property_readonly(
          "findings_json",
          [](const step_event& e) {
            std::vector<std::string> findings;
            for (const auto& f : e.findings) findings.push_back(nanguard::to_json(f));
            return findings;
          },
          "Each finding of the replay as its JSON (nanguard::to_json).")
      .def_readonly("rollback_to", &step_event::rollback_to)
      .def_readonly("bundle", &step_event::bundle)
      .def_readonly("remedy", &step_event::remedy)
      .def_readonly("note", &step_event::note)
      .def_readonly("auto_fix", &step_event::auto_fix,
                    "auto_fix: the verified op rewrite kept in force for the rest of the run (\"\": none).")
      .def_property_readonly(
          "forecast",
          [](const step_event& e) -> std::optional<std::string> {
            if (!e.forecast) return std::nullopt;
            return nanguard::to_string(*e.forecast);
          },
          "Where the loss or grad norm leaves its dtype's range at its trend (forecast.h), None when healthy.")
      .def("to_json", [](const step_event& e) { return nanguard::to_json(e); }, "The event log's line (JSON).")
      // Pickled as StepEvent(its line): a StepResult (a NonFiniteError's)
      // crosses processes. __reduce__ rather than py::pickle, whose
      // __setstate__ aborts the interpreter under protocols 0 and 1.
      .def("__reduce__", [](const py::object& self) {
        return py::make_tuple(py::type::of(self), py::make_tuple(self.attr("to_json")()));
      });
  // nanguard.data writes its data events to the guard's log through it, in
  // the schema `nanguard report` reads.
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
}

}  // namespace nanguard::python
