// data_bindings.cpp — the data firewall and the isolation forest.
#include "bindings.h"

#include <nanguard/csv.h>
#include <nanguard/firewall.h>
#include <nanguard/isolation_forest.h>

#include <tuple>

namespace {

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

}  // namespace

namespace nanguard::python {

/// The IsolationForest.
void bind_isolation_forest(py::module_& m) {
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
           without_gil(), "Grows the trees on finite x [rows, features]; returns self.")
      .def("score_samples", &nanguard::isolation_forest::score_samples, py::arg("x"),
           without_gil(), "Per-row score (float64); lower is more abnormal.")
      .def("decision_function", &nanguard::isolation_forest::decision_function, py::arg("x"),
           without_gil(), "score_samples(x) - offset: negative for outliers.")
      .def("predict", &nanguard::isolation_forest::predict, py::arg("x"),
           without_gil(), "-1 for outliers, +1 for inliers (int64).")
      .def_property_readonly("offset", &nanguard::isolation_forest::offset)
      .def_property_readonly("fitted", &nanguard::isolation_forest::fitted)
      .def_property_readonly("features", &nanguard::isolation_forest::features);
}

/// The Firewall and its report.
void bind_firewall(py::module_& m) {
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
                     .nonfinite(nanguard::nonfinite_policy_from_string(nonfinite))
                     .outliers(nanguard::outlier_policy_from_string(outliers))
                     .rule(nanguard::outlier_rule_from_string(rule))
                     .low_quantile(low_quantile)
                     .high_quantile(high_quantile)
                     .sigmas(sigmas)
                     .robust_z(robust_z)
                     .nan_value(nan_value)
                     .label_columns(std::move(label_columns))
                     .column_names(std::move(column_names)));
           }),
           // The numeric defaults are the C++ options' own.
           py::arg("nonfinite") = "raise", py::arg("outliers") = "ignore", py::arg("rule") = "quantile_range",
           py::arg("low_quantile") = nanguard::firewall_options().low_quantile(),
           py::arg("high_quantile") = nanguard::firewall_options().high_quantile(),
           py::arg("sigmas") = nanguard::firewall_options().sigmas(),
           py::arg("robust_z") = nanguard::firewall_options().robust_z(),
           py::arg("nan_value") = nanguard::firewall_options().nan_value(),
           py::arg("label_columns") = std::vector<int64_t>{}, py::arg("column_names") = std::vector<std::string>{})
      .def("fit", py::overload_cast<const at::Tensor&>(&nanguard::firewall::fit), py::arg("data"),
           py::return_value_policy::reference_internal, without_gil(),
           "Fits medians and outlier bounds on data [rows, features]; returns self.")
      .def("apply", [](const nanguard::firewall& fw, const at::Tensor& batch) {
             nanguard::firewall_result r = fw.apply(batch);
             return std::make_tuple(std::move(r.batch), std::move(r.report));
           },
           py::arg("batch"), without_gil(), "(cleaned batch, FirewallReport); raises ValueError under a 'raise' policy.")
      .def_property_readonly("fitted", &nanguard::firewall::fitted)
      .def_property_readonly("lower_bounds", &nanguard::firewall::lower_bounds)
      .def_property_readonly("upper_bounds", &nanguard::firewall::upper_bounds);
}

/// read_csv (nanguard.data.read_csv checks the path and the delimiter).
void bind_csv(py::module_& m) {
  m.def("read_csv", [](const std::string& path, char delimiter) {
    nanguard::csv_table t = nanguard::read_csv(path, nanguard::csv_options().delimiter(delimiter));
    return std::make_tuple(std::move(t.columns), std::move(t.data));
  }, py::arg("path"), py::arg("delimiter") = ',', without_gil(),
        "(columns, [rows, columns] float64 tensor) of a numeric CSV file.");
}

}  // namespace nanguard::python
