#include "nanguard/fault_injection.h"

#include "detail/armed_fault.h"
#include "detail/enum_from_string.h"
#include "detail/observer_slot.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>

#include <fmt/format.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <sstream>

namespace nanguard {
namespace {

constexpr fault_kind all_fault_kinds[] = {fault_kind::nan, fault_kind::pos_inf, fault_kind::neg_inf,
                                          fault_kind::bit_flip, fault_kind::scale};
constexpr fault_mode all_fault_modes[] = {fault_mode::transient, fault_mode::persistent};
constexpr direction all_directions[] = {direction::forward, direction::backward};

}  // namespace

const char* to_string(fault_kind k) {
  switch (k) {
    case fault_kind::nan: return "nan";
    case fault_kind::pos_inf: return "inf";
    case fault_kind::neg_inf: return "-inf";
    case fault_kind::bit_flip: return "bit_flip";
    case fault_kind::scale: return "scale";
  }
  return "?";
}

fault_kind fault_kind_from_string(const std::string& name) {
  return detail::enum_from_string(name, all_fault_kinds, "fault_kind");
}

const char* to_string(fault_mode m) { return m == fault_mode::transient ? "transient" : "persistent"; }

fault_mode fault_mode_from_string(const std::string& name) {
  return detail::enum_from_string(name, all_fault_modes, "fault_mode");
}

namespace {

// `value` read whole by `parse` (std::stoll, std::stod); an error naming
// field `key` and `what` it must be otherwise.
template <typename Parse>
auto parsed(const std::string& key, const std::string& value, const char* what, Parse parse) {
  size_t used = 0;
  decltype(parse(value, &used)) x{};
  try {
    x = parse(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK(used == value.size() && !value.empty(), "nanguard::fault_spec_from_string: ", key, " must be ", what,
              " but is '", value, "'");
  return x;
}

int64_t integer_of(const std::string& key, const std::string& value) {
  return parsed(key, value, "an integer", [](const std::string& v, size_t* used) { return std::stoll(v, used); });
}

double number_of(const std::string& key, const std::string& value) {
  return parsed(key, value, "a number", [](const std::string& v, size_t* used) { return std::stod(v, used); });
}

// Sets the field `key` of `s` from its text.
void set_field(fault_spec& s, const std::string& key, const std::string& value) {
  if (key == "op") s.op(value);
  else if (key == "step") s.step(integer_of(key, value));
  else if (key == "rank") s.rank(integer_of(key, value));
  else if (key == "direction") s.direction(detail::enum_from_string(value, all_directions, "direction"));
  else if (key == "occurrence") s.occurrence(integer_of(key, value));
  else if (key == "kind") s.kind(fault_kind_from_string(value));
  else if (key == "bit") s.bit(integer_of(key, value));
  else if (key == "factor") s.factor(number_of(key, value));
  else if (key == "element") s.element(integer_of(key, value));
  else if (key == "mode") s.mode(fault_mode_from_string(value));
  else
    TORCH_CHECK(false, "nanguard::fault_spec_from_string: no field '", key, "'; the fields are op, step, rank, "
                "direction, occurrence, kind, bit, factor, element and mode (e.g. 'op=aten::addmm,step=5,kind=nan')");
}

}  // namespace

fault_spec fault_spec_from_string(const std::string& text) {
  fault_spec s;
  std::stringstream fields(text);
  for (std::string field; std::getline(fields, field, ',');) {
    const size_t eq = field.find('=');
    TORCH_CHECK(eq != std::string::npos, "nanguard::fault_spec_from_string: '", field,
                "' is not key=value; write e.g. 'op=aten::addmm,step=5,kind=nan'");
    set_field(s, field.substr(0, eq), field.substr(eq + 1));
  }
  TORCH_CHECK(!s.op().empty(), "nanguard::fault_spec_from_string: no op in '", text,
              "'; name the ATen op whose output is corrupted: 'op=aten::addmm,...'");
  return s;
}

std::string to_string(const fault_spec& s) {
  std::string text = fmt::format("op={},step={},rank={},direction={},occurrence={},kind={}", s.op(), s.step(),
                                 s.rank(), to_string(s.direction()), s.occurrence(), to_string(s.kind()));
  if (s.kind() == fault_kind::bit_flip) text += fmt::format(",bit={}", s.bit());
  if (s.kind() == fault_kind::scale) text += fmt::format(",factor={}", s.factor());
  return text + fmt::format(",element={},mode={}", s.element(), to_string(s.mode()));
}

struct fault_injector::state {
  fault_spec spec;
  int64_t rank = 0;
  std::atomic<int64_t> step{0};
  std::atomic<int64_t> calls{0};  // of the op in the spec's direction, since the last rewind
  std::atomic<int64_t> fired{0};
  std::mutex mutex;
  std::string last;  // what it did last
  at::CallbackHandle handle = 0;
};

namespace {

std::atomic<fault_injector::state*> armed{nullptr};

bool is_aten_op(const std::string& name) {
  for (const c10::OperatorName& op : c10::Dispatcher::singleton().getAllOpNames())
    if (op.name == name) return true;
  return false;
}

// The position of flat index `element` in a tensor of `sizes`.
std::vector<int64_t> position_of(int64_t element, at::IntArrayRef sizes) {
  std::vector<int64_t> position(sizes.size());
  for (int64_t d = int64_t(sizes.size()) - 1; d >= 0; --d) {
    position[size_t(d)] = element % sizes[size_t(d)];
    element /= sizes[size_t(d)];
  }
  return position;
}

// `value` with bit `bit` of its bytes flipped (little-endian: bit 0 is the lowest of byte 0).
at::Tensor flipped(const at::Tensor& value, int64_t bit) {
  at::Tensor host = value.to(at::kCPU).clone();
  auto* bytes = static_cast<unsigned char*>(host.data_ptr());
  bytes[bit / 8] ^= static_cast<unsigned char>(1u << (bit % 8));
  return host;
}

// Writes the fault into element `element` of `out`, below autograd: no
// version bump, so that a backward that saved `out` runs on the corrupted
// value as it would after a hardware fault.
void corrupt(const at::Tensor& out, const fault_spec& spec) {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  int64_t offset = out.storage_offset();
  const std::vector<int64_t> position = position_of(spec.element(), out.sizes());
  for (size_t d = 0; d < position.size(); ++d) offset += position[d] * out.stride(int64_t(d));
  at::Tensor cell = out.as_strided({}, {}, offset);
  switch (spec.kind()) {
    case fault_kind::nan: cell.fill_(std::numeric_limits<double>::quiet_NaN()); break;
    case fault_kind::pos_inf: cell.fill_(HUGE_VAL); break;
    case fault_kind::neg_inf: cell.fill_(-HUGE_VAL); break;
    case fault_kind::bit_flip: cell.copy_(flipped(cell, spec.bit())); break;
    case fault_kind::scale: cell.mul_(spec.factor()); break;
  }
}

// The op's first floating-point output that holds the spec's element.
const at::Tensor* target_of(const at::RecordFunction& fn, const fault_spec& spec) {
  for (const c10::IValue& v : fn.outputs())
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (t.defined() && at::isFloatingType(t.scalar_type()) && spec.element() < t.numel()) return &t;
    }
  return nullptr;
}

bool matches(fault_injector::state& s, const at::RecordFunction& fn) {
  const fault_spec& spec = s.spec;
  if (std::strcmp(fn.name(), spec.op().c_str()) != 0) return false;
  const bool backward = torch::autograd::get_current_node() != nullptr;
  if (backward != (spec.direction() == direction::backward)) return false;
  if (spec.rank() >= 0 && spec.rank() != s.rank) return false;
  const int64_t step = s.step.load(std::memory_order_relaxed);
  const bool due = spec.mode() == fault_mode::persistent ? step >= spec.step()
                                                         : step == spec.step() && s.fired.load() == 0;
  return due && s.calls.fetch_add(1) == spec.occurrence();
}

void on_op_end(const at::RecordFunction& fn, at::ObserverContext*) {
  fault_injector::state* s = armed.load(std::memory_order_acquire);
  if (s == nullptr || detail::in_observer_callback || !matches(*s, fn)) return;
  const detail::callback_scope inside;  // its own ops are not the model's: no observer sees them
  const at::Tensor* out = target_of(fn, s->spec);
  const std::lock_guard<std::mutex> lock(s->mutex);
  if (out == nullptr) {
    s->last = fmt::format("not injected: {} (call {}) at step {} has no floating-point output with element {}",
                          fn.name(), s->spec.occurrence(), s->step.load(), s->spec.element());
    return;
  }
  corrupt(*out, s->spec);
  s->fired.fetch_add(1);
  std::string where;
  for (int64_t p : position_of(s->spec.element(), out->sizes())) where += (where.empty() ? "" : ", ") + std::to_string(p);
  s->last = fmt::format("{} written into [{}] of the output of {} ({}, call {}) at step {}", to_string(s->spec.kind()),
                        where, fn.name(), to_string(s->spec.direction()), s->spec.occurrence(), s->step.load());
}

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction&) { return nullptr; }

}  // namespace

fault_injector::fault_injector(fault_spec spec, int64_t rank) : state_(std::make_unique<state>()) {
  const char* where = "nanguard::fault_injector";
  TORCH_CHECK(is_aten_op(spec.op()), where, ": '", spec.op(), "' is not an operator PyTorch knows; name one the "
              "model runs, as a finding names it (e.g. 'aten::addmm', 'aten::log')");
  TORCH_CHECK(spec.step() >= 0, where, ": step must be >= 0 but is ", spec.step());
  TORCH_CHECK(spec.occurrence() >= 0, where, ": occurrence must be >= 0 but is ", spec.occurrence());
  TORCH_CHECK(spec.element() >= 0, where, ": element must be >= 0 but is ", spec.element());
  TORCH_CHECK(spec.bit() >= 0 && spec.bit() < 64, where, ": bit must be in [0, 63] but is ", spec.bit(),
              " (float32: 31 is the sign, 23-30 the exponent)");
  TORCH_CHECK(spec.rank() >= -1, where, ": rank must be >= 0 (or -1: every rank) but is ", spec.rank());
  state_->spec = std::move(spec);
  state_->rank = rank;
  state* expected = nullptr;
  TORCH_CHECK(armed.compare_exchange_strong(expected, state_.get()), where,
              ": another fault is armed; one at a time (destroy it, or give the guard one spec)");
  at::RecordFunctionCallback callback(on_op_start, on_op_end);
  callback.needsOutputs(true).scopes({at::RecordScope::FUNCTION});
  state_->handle = at::addGlobalCallback(std::move(callback));
}

fault_injector::~fault_injector() {
  at::removeCallback(state_->handle);
  armed.store(nullptr, std::memory_order_release);
}

const fault_spec& fault_injector::spec() const { return state_->spec; }

void fault_injector::set_step(int64_t step) { state_->step.store(step); }

void fault_injector::rewind() { state_->calls.store(0); }

int64_t fault_injector::fired() const { return state_->fired.load(); }

std::string fault_injector::last_fired() const {
  const std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->last;
}

namespace detail {

void rewind_armed_fault() {
  if (fault_injector::state* s = armed.load(std::memory_order_acquire)) s->calls.store(0);
}

}  // namespace detail
}  // namespace nanguard
