// tracer_state.cpp — what the tracer's state does itself: the count of
// what a tracer read, for tracer::cost() (tracer_options::measure_cost).
#include "tracer_state.h"

#include <string>

namespace nanguard::detail {

void add_scan_to_cost(tracer_state& st, const at::Tensor& t, const char* op, scanned what) {
  const int64_t bytes = t.numel() * int64_t(t.element_size());
  st.scans.fetch_add(1, std::memory_order_relaxed);
  st.scanned_bytes.fetch_add(bytes, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(st.mutex);
  const char* suffix = what == scanned::old_values  ? " (old values)"
                       : what == scanned::parameter ? " (parameter)"
                       : what == scanned::node_input ? " (gradient into the node)"
                                                     : "";
  const std::string key = std::string(op) + suffix;
  tracer_op_scans& entry = st.scans_by_op[key];
  entry.op = key;
  entry.scans += 1;
  entry.bytes += bytes;
}

}  // namespace nanguard::detail
