// events_bindings.cpp — the guard's outputs: its JSONL event log and TensorBoard tags.
#include "bindings.h"

#include <nanguard/events.h>
#include <nanguard/tensorboard.h>

namespace nanguard::python {

/// The EventLog and a step event's TensorBoard scalars and text.
void bind_events(py::module_& m) {
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
