// diagnosis.h — why a NaN or Inf was born, and what to change: the likely
// cause of a finding, decided from the evidence it carries (the op, the
// direction, the census of its inputs and outputs, the dtype) and from what
// the guard knows of the steps before (gradient norms, losses, LR, loss
// scale, which tensors are the input batch).
//
// The tracer diagnoses every finding it makes; the guard diagnoses its
// findings again with its history. docs/diagnosis.md has the taxonomy; the
// causes and the record a finding carries are in cause.h.
//
//   for (const nanguard::finding& f : tracer.findings())
//     std::cerr << to_string(f.diagnosis) << "\n";
//   // log_of_nonpositive (high): log of 0: 3 of 64 inputs are exactly 0 ...
//   //   remedy: log_softmax instead of log(softmax(x)) ...
#pragma once

#include <nanguard/cause.h>

#include <string>
#include <vector>

namespace nanguard {

struct finding;

/// The front end a run trains through: a remedy names the option or the
/// one-liner that works there (docs/diagnosis.md).
enum class front_end {
  unknown,       ///< not known (a tracer on its own): C++ and Python one-liners both, or the
                 ///< process's language once set (the Python module's: spelling.h)
  cpp,           ///< nanguard::guard in a C++ loop
  python,        ///< nanguard.Guard in a Python loop
  lightning,     ///< the Lightning callback (nanguard.integrations.lightning.NanGuard)
  transformers,  ///< the Hugging Face callback (nanguard.integrations.transformers.NanGuardCallback)
  cli,           ///< `nanguard train` on a CSV file
};

/// Every front end, in declaration order.
inline constexpr front_end all_front_ends[] = {front_end::unknown,   front_end::cpp,          front_end::python,
                                               front_end::lightning, front_end::transformers, front_end::cli};

/// What the guard knows besides the finding; every field may stay empty.
struct diagnosis_context {
  /// Losses of the steps before (finite ones), oldest first; the bad step's
  /// own loss last when it was finite (its gradients were not).
  std::vector<double> losses;
  /// Global gradient norms of the finite steps before, oldest first.
  std::vector<double> grad_norms;
  double lr = 0;          ///< learning rate at the bad step (0: unknown)
  double loss_scale = 1;  ///< loss scale at the bad step
  /// Names of the tensors that are the input batch ("batch[0]", "labels"). A
  /// finding whose culprit is one of them (or a view of one), unnamed
  /// ("input 0") or named "batch..." counts as data.
  std::vector<std::string> data;
  /// The front end the remedies are written for.
  nanguard::front_end front_end = front_end::unknown;
  /// The file the run's data came from (`nanguard train --data`): named in a
  /// bad_data remedy (`nanguard scan FILE`); "" when the data is no file.
  std::string data_file;
};

/// The likely cause of `f` from its evidence (and `context`'s history).
///
/// Decided from the numbers, not from the op name alone: a div is x/0 only
/// when its denominator holds zeros, an exp overflows only when its input
/// passes log(largest value of the dtype). What no class fits is
/// `unclassified`, with the raw evidence.
///
///   nanguard::diagnosis d = nanguard::diagnose(finding, {/*losses*/ {}, /*grad_norms*/ norms});
///   if (d.cause == nanguard::cause::divergence) { /* lower the LR */ }
diagnosis diagnose(const finding& f, const diagnosis_context& context = {});

/// "unknown", "cpp", "python", "lightning", "transformers", "cli".
const char* to_string(front_end e);
/// The front end named `name`. Throws c10::Error listing the names for another.
front_end front_end_from_string(const std::string& name);

}  // namespace nanguard
