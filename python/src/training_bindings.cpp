// training_bindings.cpp — the parts of a guarded step: sentinel, clipping, LR schedule, loss scaler.
#include "bindings.h"

#include <nanguard/clip.h>
#include <nanguard/loss_scaler.h>
#include <nanguard/schedule.h>
#include <nanguard/sentinel.h>

namespace nanguard::python {

/// The Sentinel (grad and loss checks) and clip_coefficient.
void bind_sentinel(py::module_& m) {
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
           without_gil())
      .def("apply_factor_", &nanguard::sentinel::apply_factor_, py::arg("factor"),
           without_gil())
      .def("observe", [](nanguard::sentinel& s, double loss, double norm) {
        std::vector<std::tuple<std::string, double, double>> out;
        for (const auto& sp : s.observe(loss, norm)) out.emplace_back(sp.series, sp.value, sp.z);
        return out;
      }, "Spikes of loss and grad norm as (series, value, z).")
      .def("reset_spikes", &nanguard::sentinel::reset_spikes)
      .def_property_readonly("names", &nanguard::sentinel::names);
  m.def("clip_coefficient", &nanguard::clip_coefficient, py::arg("total_norm"), py::arg("max_norm"));
}

/// The WarmupCosine LR schedule.
void bind_schedule(py::module_& m) {
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
}

/// The LossScaler.
void bind_loss_scaler(py::module_& m) {
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
}

}  // namespace nanguard::python
