// finding.h — what the tracer reports about a non-finite value: which op
// made it, where, when, what its inputs and outputs looked like, and its
// likely cause and fix (cause.h; diagnose() in diagnosis.h decides it).
#pragma once

#include <nanguard/cause.h>
#include <nanguard/census.h>
#include <nanguard/remedy_check.h>
#include <nanguard/source_location.h>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <vector>

namespace nanguard {

/// Whether an op ran in the forward pass or inside an autograd node.
enum class direction { forward, backward };

/// How an op relates to the non-finite value it output.
enum class role {
  producer,    ///< all inputs finite, output not: this op made the NaN/Inf
  propagator,  ///< a non-finite input flowed through this op
  input,       ///< a non-finite value entered from data or a parameter
};

/// Every direction, in declaration order.
inline constexpr direction all_directions[] = {direction::forward, direction::backward};
/// Every role, in declaration order.
inline constexpr role all_roles[] = {role::producer, role::propagator, role::input};

/// "forward" / "backward".
const char* to_string(direction d);
/// The direction whose to_string is `name`. Throws c10::Error listing the names for another.
direction direction_from_string(const std::string& name);
/// "producer" / "propagator" / "input".
const char* to_string(role r);
/// The role whose to_string is `name`. Throws c10::Error listing the names for another.
role role_from_string(const std::string& name);

/// One tensor an op read or wrote, with its census.
struct tensor_record {
  std::string name;    ///< "input 0", "output 0", or a parameter's name
  std::string dtype;   ///< "Float", "Half", ...
  std::vector<int64_t> shape;
  tensor_stats stats;  ///< census of the tensor when the op ended
};

/// The report about one op that output a NaN or Inf.
struct finding {
  int64_t step = -1;                     ///< training step (tracer::set_step)
  source_location source;                ///< the user's line the op ran from (backward: its forward op's)
  std::string op;                        ///< the ATen op, e.g. "aten::div"
  std::string caller;                    ///< the outermost op it ran inside ("aten::to"), if any
  nanguard::direction direction = direction::forward;
  std::string node;                      ///< backward: autograd node, e.g. "SqrtBackward0"
  std::string forward_op;                ///< backward: the forward op that made the node
  nanguard::role role = role::producer;
  std::string module;                    ///< dotted module path, "" if unknown
  std::string culprit;                   ///< role input: the non-finite tensor (parameter name or "input k")
  std::vector<tensor_record> inputs;     ///< the op's floating-point inputs
  std::vector<tensor_record> outputs;    ///< the op's floating-point outputs
  int output = 0;                        ///< which output holds the bad value
  int64_t index = -1;                    ///< flat index of its first non-finite element
  /// The dataset index of the batch row the bad value came from, when the
  /// guard knows the rows' (guard::set_sample_indices) and the finding
  /// reads a batch tensor; -1 unknown.
  int64_t dataset_index = -1;
  double value = 0;                      ///< that element: NaN, +Inf or -Inf
  uint64_t thread = 0;                   ///< the thread the op ran on
  int64_t sequence_nr = -1;              ///< autograd sequence number linking forward and backward
  std::string backtrace;                 ///< C++ call site, when captured
  int64_t rank = -1;                     ///< distributed: the rank that saw it (-1: single process)
  nanguard::diagnosis diagnosis;         ///< the likely cause, its evidence and the remedy
  /// The remedies the guard tried on a replay of the step, in order
  /// (remedy_check.h; verified_remedy() gives the one to take); empty when
  /// none was tried.
  std::vector<remedy_check> remedy_checks;
  /// With tracer_options::keep_inputs: copies of the op's inputs (those of
  /// `inputs`) as they were when it started. Not part of the JSON.
  std::vector<at::Tensor> input_values;
};

/// The position of the first non-finite element in its output (`[24, 0]`
/// for flat index 48 of a [32, 2] output); the flat index alone when the
/// output's shape is not listed.
std::vector<int64_t> element_position(const finding& f);

/// One line, the user's line first when known:
/// `train.py:42 (forward): step 3 forward aten::div in norm: producer, output 0 [24, 0] = nan`
/// (then `, dataset index 1024` when known).
std::string to_string(const finding& f);
/// Several lines, with the census of every input and output, then the
/// diagnosis (cause, evidence, remedy).
std::string to_text(const finding& f);
/// A JSON object with every field (census included).
std::string to_json(const finding& f);
/// Reads a finding back from `to_json`'s output. A finding written before
/// diagnoses existed (no "diagnosis" field) is diagnosed on reading.
finding finding_from_json(const std::string& json);

/// Thrown when a non-finite value must stop the caller; carries the finding.
/// A c10::Error, as every error nanguard throws (what_without_backtrace()
/// is the one line to show).
class nonfinite_error : public c10::Error {
 public:
  explicit nonfinite_error(nanguard::finding f);
  /// The finding that caused the error.
  const nanguard::finding& finding() const { return finding_; }

 private:
  nanguard::finding finding_;
};

}  // namespace nanguard
