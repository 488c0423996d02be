#include "nanguard/diagnosis.h"

#include "nanguard/finding.h"
#include "nanguard/float_formats.h"
#include "nanguard/sentinel.h"
#include "nanguard/spelling.h"

#include "detail/enum_from_string.h"
#include "detail/median.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>

namespace nanguard {
namespace {

using rule = std::optional<diagnosis> (*)(const finding&);

// ------------------------------------------------------------ remedies

// In the order of enum class front_end (all_front_ends).
constexpr const char* kFrontEndNames[] = {"unknown", "cpp", "python", "lightning", "transformers", "cli"};
static_assert(std::size(kFrontEndNames) == size_t(front_end::cli) + 1, "a name for every front end");
static_assert(std::size(all_front_ends) == std::size(kFrontEndNames), "every front end in all_front_ends");

// A one-liner in the language of the front end: C++ `cpp` or Python `py`
// (a Python model under the CLI too), both when the front end is unknown.
std::string code(front_end e, const std::string& cpp, const std::string& py) {
  if (e == front_end::unknown) return fmt::format("C++ `{}`, Python `{}`", cpp, py);
  return fmt::format("`{}`", e == front_end::cpp ? cpp : py);
}

// The same where the one-liners are spelled alike.
std::string code(front_end e, const std::string& both) { return code(e, both, both); }

// `text` where C++ code is read (nanguard's C++ helpers), else "".
std::string cpp_only(front_end e, const std::string& text) {
  return e == front_end::cpp || e == front_end::unknown ? text : "";
}

// Clipping and a lower LR, as the front end sets them.
std::string clip_and_lower_lr(front_end e) {
  const char* how = "";
  switch (e) {
    case front_end::unknown:
      how = "C++ `guard_options().max_norm(1.0)`, Python `nanguard.Guard(model, opt, max_norm=1.0)`";
      break;
    case front_end::cpp: how = "`guard_options().max_norm(1.0)`"; break;
    case front_end::python: how = "`nanguard.Guard(model, opt, max_norm=1.0)`"; break;
    case front_end::lightning: how = "`Trainer(gradient_clip_val=1.0)`, a lower lr in configure_optimizers"; break;
    case front_end::transformers:
      how = "`TrainingArguments(max_grad_norm=1.0, warmup_ratio=0.1)` and a lower learning_rate";
      break;
    case front_end::cli: how = "`--clip 1.0`, a lower `--lr`, `--warmup`"; break;
  }
  return fmt::format("clip the gradients and lower the LR or warm up longer ({})", how);
}

// Keeping float16's overflow out, as the front end can.
std::string loss_scaling(front_end e) {
  switch (e) {
    case front_end::unknown:
      return "dynamic loss scaling (C++ `guard_options().scaler(loss_scaler_options().enabled(true))`, Python "
             "`nanguard.Guard(model, opt, loss_scale=True)`), bfloat16 instead of float16";
    case front_end::cpp:
      return "dynamic loss scaling (`guard_options().scaler(loss_scaler_options().enabled(true))`), bfloat16 "
             "instead of float16 (`torch::kBFloat16`)";
    case front_end::python:
      return "dynamic loss scaling (`nanguard.Guard(model, opt, loss_scale=True)`), bfloat16 instead of float16 "
             "(`torch.autocast(\"cuda\", dtype=torch.bfloat16)`)";
    case front_end::lightning:
      return "bfloat16, which has float32's range (`Trainer(precision=\"bf16-mixed\")`), or float16 with "
             "Lightning's loss scaling (`Trainer(precision=\"16-mixed\")`, not \"16-true\")";
    case front_end::transformers:
      return "bfloat16, which has float32's range (`TrainingArguments(bf16=True)`), or float16 with the Trainer's "
             "loss scaling (`TrainingArguments(fp16=True)`, not a model cast with .half())";
    case front_end::cli: return "a float32 model (save the TorchScript model after `model.float()`)";
  }
  return "";
}

// The data firewall, where the front end's data passes; for a CSV file,
// `nanguard scan` names its lines.
std::string data_firewall(front_end e, const std::string& culprit, const std::string& file) {
  const std::string py_collate = "nanguard.data.firewall_collate(nanguard.Firewall(nonfinite=\"drop\").fit(train_x))";
  std::string r;
  switch (e) {
    case front_end::unknown:
      r = "validate the data: the firewall drops or repairs rows with NaN/Inf (C++ "
          "`nanguard::firewall(firewall_options().nonfinite(nonfinite_policy::drop))`, Python "
          "`nanguard.Firewall(nonfinite=\"drop\")`; in a DataLoader `collate_fn=" + py_collate + "`)";
      break;
    case front_end::cpp:
      r = "validate each batch: the firewall drops or repairs rows with NaN/Inf "
          "(`nanguard::firewall(firewall_options().nonfinite(nonfinite_policy::drop)).apply(batch)`)";
      break;
    case front_end::python:
    case front_end::lightning:
      r = "validate the data where the DataLoader collates it: it drops or repairs rows with NaN/Inf "
          "(`DataLoader(dataset, collate_fn=" + py_collate + ")`, or `nanguard.data.FirewallDataset(dataset, fw)`)";
      break;
    case front_end::transformers: {
      // The batch's key: "labels" of the culprit "labels (view)" or "labels[0]".
      const std::string field = culprit.substr(0, culprit.find_first_of(" ["));
      const std::string key = field.empty() || culprit.rfind("input ", 0) == 0 || field == "batch" ? "FEATURES" : field;
      r = "validate the data where the Trainer collates it: it drops or repairs rows with NaN/Inf "
          "(`Trainer(data_collator=nanguard.data.firewall_collate(fw, collate_fn=default_data_collator, field=\"" +
          key + "\"))`, fw a `nanguard.Firewall(nonfinite=\"drop\")`; the field a [batch, features] tensor)";
      break;
    }
    case front_end::cli: r = "validate the data: `--firewall drop` or `--firewall repair`"; break;
  }
  if (!file.empty()) r += fmt::format("; `nanguard scan {}` names the CSV lines that hold NaN/Inf", file);
  return r;
}

// More findings of the tracer: the chain from the first infinity.
std::string more_findings(front_end e) {
  if (e == front_end::cli)
    return "abort on it (`--policy abort`) and read the chain in the bundle (`nanguard inspect`)";
  return "trace with more findings to follow the chain (" +
         code(e, "tracer_options().max_findings(8)", "nanguard.trace(model, max_findings=8)") + ")";
}

// Shapes of a case that change the remedy (defined with the evidence helpers).
bool log_of_mask(const finding& f);
bool mean_over_empty_mask(const finding& f);

std::string remedy_for(cause c, const finding& f, const diagnosis_context& ctx) {
  // A finding of no known front end (a tracer on its own) is written for
  // the process's language: Python's alone once the module is imported.
  const front_end e = ctx.front_end == front_end::unknown && message_spelling() == spelling::python
                          ? front_end::python
                          : ctx.front_end;
  switch (c) {
    case cause::log_of_nonpositive:
      if (log_of_mask(f))
        return "make the additive mask without a log, which is -inf where the mask is 0 (" +
               code(e, "torch::where(mask.to(torch::kBool), 0.0, std::numeric_limits<float>::lowest())",
                    "torch.where(mask.bool(), 0.0, torch.finfo(scores.dtype).min)") +
               ": 0 where kept, a large finite negative where masked), or mask the scores themselves (" +
               code(e, "scores.masked_fill(~mask.to(torch::kBool), std::numeric_limits<float>::lowest())",
                    "scores.masked_fill(~mask.bool(), torch.finfo(scores.dtype).min)") + ")";
      return "take the log in log space: log_softmax / logsigmoid instead of log(softmax(x)) / log(sigmoid(x)) (" +
             code(e, "torch::log_softmax(x, -1)", "torch.log_softmax(x, -1)") +
             cpp_only(e, "; nanguard::cross_entropy") + "), or clamp first (" +
             code(e, "torch::log(p.clamp_min(1e-12))", "torch.log(p.clamp_min(1e-12))") +
             cpp_only(e, "; nanguard::safe_log") + ")";
    case cause::division_by_zero:
      if (mean_over_empty_mask(f))
        return "divide a masked sum by at least 1 (" + code(e, "(x * mask).sum(1) / mask.sum(1).clamp_min(1)") +
               ": 0 for a row whose mask is all 0), or keep rows with nothing in their mask out of the batch";
      return "put an eps in the denominator (" + code(e, "x / (x.std(0) + 1e-5)") +
             cpp_only(e, ", nanguard::standardize(x, 0), nanguard::safe_div") +
             "); look for zero-variance features (a constant column) and batches of 1";
    case cause::overflow:
      return "keep the exponent small: subtract the max (" +
             code(e, "torch::logsumexp(x, -1)", "torch.logsumexp(x, -1)") + "), clamp it (" +
             code(e, "torch::exp(x.clamp_max(80))", "torch.exp(x.clamp(max=80))") +
             "); if the values grew over training, " + clip_and_lower_lr(e);
    case cause::fully_masked_softmax:
      // mask: true where masked, as masked_fill and a key padding mask take it.
      return "give rows with nothing to attend to a defined result: mask with a large finite value instead of -inf (" +
             code(e, "scores.masked_fill(mask, std::numeric_limits<float>::lowest()).softmax(-1)",
                  "scores.masked_fill(mask, torch.finfo(scores.dtype).min).softmax(-1)") +
             ": such a row comes out uniform), then zero those rows if they must not count (" +
             code(e, "p.masked_fill(mask.all(-1, true), 0.0)", "p.masked_fill(mask.all(-1, keepdim=True), 0.0)") +
             cpp_only(e, "; nanguard::masked_softmax(scores, mask) does both") +
             "); a sequence that is all padding (a key padding mask row of all true) has nothing to attend to: "
             "keep such sequences out of the batch";
    case cause::sqrt_at_zero:
      return "keep the argument away from 0 (" + code(e, "torch::sqrt(x + 1e-12)", "torch.sqrt(x + 1e-12)") +
             cpp_only(e, ", nanguard::safe_sqrt(x)") +
             "); a safe norm: `(x * x).sum(-1).add(1e-12).sqrt()`";
    case cause::inverse_trig_at_bound:
      return "clamp into the open interval (" +
             code(e, "torch::acos(x.clamp(-1 + 1e-6, 1 - 1e-6))", "torch.acos(x.clamp(-1 + 1e-6, 1 - 1e-6))") +
             "; the same for asin, atanh)";
    case cause::inf_arithmetic:
      return "find the earlier infinity: " + more_findings(e) + "; mask with a large finite value instead of inf (" +
             code(e, "x.masked_fill(mask, -1e9)") + ") or select with where instead of multiplying by 0";
    case cause::precision_range: {
      const std::string module = f.module.empty() ? "the module" : f.module;
      return fmt::format("{}, or keep {} in float32 ({})", loss_scaling(e), module,
                         code(e, module + "->to(torch::kFloat)", module + ".float()"));
    }
    case cause::divergence:
      // (The guard's default policy, auto, already rolls a divergence back and cuts the LR: the fix is the user's.)
      return clip_and_lower_lr(e) + "; until then the guard's default policy (auto) rolls a divergence back to "
             "the last calm snapshot and halves the LR";
    case cause::bad_data: return data_firewall(e, f.culprit, ctx.data_file);
    case cause::masked_infinity_reduced:
      // A very large finite mask value is no fix here: a sum over it overflows again.
      return "keep the masked entries out of the reduction: label smoothing reads every class, masked ones too "
             "(smooth over the unmasked classes only, or " +
             code(e, "torch::nn::functional::cross_entropy(logits, y)", "F.cross_entropy(logits, y)") +
             " without label_smoothing); a sum or mean of a masked tensor: sum only the kept entries (" +
             code(e, "x.masked_fill(mask, 0).sum(-1)", "x.masked_fill(mask, 0.0).sum(-1)") + ")";
    case cause::constant_in_model:
      return "find where the model's code computes that number (a division of Python floats, a config value, "
             "`float(\"inf\")` where a large finite value was meant) and make it finite (" +
             code(e, "std::numeric_limits<float>::lowest()", "torch.finfo(x.dtype).min") + " for a mask)";
    case cause::unclassified: break;
  }
  return "no class fits the evidence: read the census of the inputs and outputs, " + more_findings(e) +
         ", or examine the repro bundle with `nanguard inspect` and `nanguard replay`";
}

// A diagnosis whose remedy diagnose() writes for the front end.
diagnosis make(cause c, confidence k, std::string evidence) { return {c, std::move(evidence), "", k}; }

// ------------------------------------------------------------ evidence helpers

std::string num(double v) { return std::isnan(v) ? "nan" : fmt::format("{:.4g}", v); }

// "aten::log_" → "log": the op without namespace and in-place mark.
std::string base_name(const std::string& op) {
  std::string name = op.substr(op.rfind(':') == std::string::npos ? 0 : op.rfind(':') + 1);
  if (name.size() > 1 && name.back() == '_') name.pop_back();
  return name;
}

bool one_of(const std::string& name, std::initializer_list<const char*> names) {
  return std::any_of(names.begin(), names.end(), [&](const char* n) { return name == n; });
}

double largest_finite(const std::string& dtype) {
  if (dtype == "Half") return fp16_max;
  if (dtype == "BFloat16") return bf16_max;
  if (dtype == "Double") return std::numeric_limits<double>::max();
  return double(std::numeric_limits<float>::max());
}

bool low_precision(const std::string& dtype) { return dtype == "Half" || dtype == "BFloat16"; }

// The output that holds the reported value (the first non-finite one otherwise).
const tensor_record* bad_output(const finding& f) {
  if (f.output >= 0 && size_t(f.output) < f.outputs.size()) return &f.outputs[f.output];
  for (const auto& r : f.outputs)
    if (!r.stats.all_finite()) return &r;
  return nullptr;
}

bool inputs_finite(const finding& f) {
  return std::all_of(f.inputs.begin(), f.inputs.end(), [](const tensor_record& r) { return r.stats.all_finite(); });
}

// The largest |x| over the inputs.
double input_absmax(const finding& f) {
  double m = 0;
  for (const auto& r : f.inputs) m = std::max(m, r.stats.absmax);
  return m;
}

// "3 NaN, 1 +Inf" (the kinds present).
std::string nonfinite_counts(const tensor_stats& s) {
  std::string out;
  const auto add = [&](int64_t n, const char* what) {
    if (n > 0) out += fmt::format("{}{} {}", out.empty() ? "" : ", ", n, what);
  };
  add(s.nan, "NaN");
  add(s.pos_inf, "+Inf");
  add(s.neg_inf, "-Inf");
  return out.empty() ? "no non-finite value" : out;
}

std::string census_line(const tensor_record& r) {
  return fmt::format("{} {}: min {} max {}, {} zeros, {} of {}", r.name, r.dtype, num(r.stats.min),
                     num(r.stats.max), r.stats.zeros, nonfinite_counts(r.stats), r.stats.numel);
}

// A tensor's name without the tracer's mark of a view ("labels (view)" →
// "labels").
std::string without_view(const std::string& name) {
  constexpr const char* kView = " (view)";
  const size_t n = std::char_traits<char>::length(kView);
  return name.size() > n && name.compare(name.size() - n, n, kView) == 0 ? name.substr(0, name.size() - n) : name;
}

bool is_batch_tensor(const std::string& name, const diagnosis_context& ctx) {
  return std::find(ctx.data.begin(), ctx.data.end(), without_view(name)) != ctx.data.end();
}

// True when a name is a parameter's (not an op's input, the batch, a gradient).
bool names_parameter(const std::string& name, const diagnosis_context& ctx) {
  for (const char* prefix : {"input ", "output ", "gradient ", "batch", "written", "loss"})
    if (name.rfind(prefix, 0) == 0) return false;
  return !is_batch_tensor(name, ctx) && !name.empty();
}

// An unnamed input ("input 1") counts as data while nothing says which
// tensors are: once they are named, it is none of them.
bool names_data(const std::string& name, const diagnosis_context& ctx) {
  return is_batch_tensor(name, ctx) || name.rfind("batch", 0) == 0 || (name.rfind("input ", 0) == 0 && ctx.data.empty());
}

// ------------------------------------------------------------ producer rules

// The backward of an op at its singular point: d sqrt(x) = 1/(2 sqrt(x)) at
// 0, d acos(x) = -1/sqrt(1 - x^2) at ±1, d log(x) = 1/x at 0. The node's
// own ops see the point as a zero in what they divide by (x, 1 - x^2).
std::optional<diagnosis> backward_at_singularity(const finding& f) {
  struct singular {
    std::initializer_list<const char*> forward_ops;
    cause c;
    const char* what;
  };
  static const singular table[] = {
      {{"sqrt", "pow", "float_power", "norm", "linalg_vector_norm", "linalg_norm", "frobenius_norm", "cdist",
        "_cdist_forward", "pairwise_distance", "_euclidean_dist"},
       cause::sqrt_at_zero,
       "its derivative (1/(2 sqrt(x)), x^(p-1)) is inf where the forward input is 0"},
      {{"acos", "asin", "atanh"}, cause::inverse_trig_at_bound,
       "its derivative (1/sqrt(1 - x^2), 1/(1 - x^2)) is inf where the forward input reaches ±1"},
      {{"log", "log2", "log10", "log1p"}, cause::log_of_nonpositive,
       "its derivative (1/x) is inf where the forward input is 0"},
  };
  if (f.direction != direction::backward) return std::nullopt;
  const std::string forward = base_name(f.forward_op);
  for (const singular& s : table) {
    if (!one_of(forward, s.forward_ops)) continue;
    // What the node divides by: the input with the most zeros.
    const tensor_record* at_zero = nullptr;
    for (const auto& r : f.inputs)
      if (r.stats.zeros > 0 && (!at_zero || r.stats.zeros > at_zero->stats.zeros)) at_zero = &r;
    if (!at_zero)
      return make(s.c, confidence::medium,
                  fmt::format("backward of {} ({}) made a non-finite gradient: {}", f.forward_op, f.node, s.what));
    return make(s.c, confidence::high,
                fmt::format("backward of {} ({}): {} of {} values it divides by are 0 ({} in {}); {}", f.forward_op,
                            f.node, at_zero->stats.zeros, at_zero->stats.numel, at_zero->name, f.op, s.what));
  }
  return std::nullopt;
}

// aten::_masked_softmax, the attention of nn.MultiheadAttention's and
// nn.TransformerEncoderLayer's fused fast path (eval), takes its mask as
// booleans, not as -inf: NaN from finite scores means rows whose every
// position is masked (a sequence that is all padding).
std::optional<diagnosis> fully_masked_rows(const finding& f) {
  const tensor_record* out = bad_output(f);
  if (base_name(f.op) != "_masked_softmax" || !out || out->stats.nan == 0 || !inputs_finite(f)) return std::nullopt;
  const int64_t row = out->shape.empty() ? 1 : std::max<int64_t>(out->shape.back(), 1);
  return make(cause::fully_masked_softmax, confidence::high,
              fmt::format("{} made {} NaN from finite scores ({} row(s) of {}): rows whose every position the mask "
                          "hides, a sequence that is all padding{}",
                          f.op, out->stats.nan, out->stats.nan / row, row,
                          f.caller.empty() ? "" : fmt::format(", inside {} (the fused fast path)", f.caller)));
}

// A NaN made from infinities: a softmax row with nothing but -inf, or
// inf - inf / 0 × inf in arithmetic.
std::optional<diagnosis> nan_from_infinities(const finding& f) {
  const tensor_record* out = bad_output(f);
  if (!out || out->stats.nan == 0) return std::nullopt;
  const tensor_record* with_inf = nullptr;
  const tensor_record* with_zero = nullptr;
  for (const auto& r : f.inputs) {
    if (!with_inf && r.stats.pos_inf + r.stats.neg_inf > 0) with_inf = &r;
    else if (!with_zero && r.stats.zeros > 0) with_zero = &r;
  }
  if (!with_inf) return std::nullopt;
  const std::string op = base_name(f.op);
  const bool softmax =
      one_of(op, {"softmax", "_softmax", "log_softmax", "_log_softmax", "scaled_dot_product_attention",
                  "_scaled_dot_product_attention_math", "_scaled_dot_product_flash_attention_for_cpu"});
  if (softmax && with_inf->stats.neg_inf > 0) {
    const int64_t row = out->shape.empty() ? 1 : std::max<int64_t>(out->shape.back(), 1);
    return make(cause::fully_masked_softmax, out->stats.nan % row == 0 ? confidence::high : confidence::medium,
                fmt::format("{} of {} row(s) with no finite entry: {} holds {} -inf (a mask) and {} of {} outputs "
                            "are NaN (rows of {})",
                            f.op, out->stats.nan / row, with_inf->name, with_inf->stats.neg_inf, out->stats.nan,
                            out->stats.numel, row));
  }
  const std::string kind = with_zero ? "0 × inf" : "inf - inf";
  const std::string zeros =
      with_zero ? fmt::format(", {} holds {} zeros", with_zero->name, with_zero->stats.zeros) : "";
  return make(cause::inf_arithmetic, confidence::medium,
              fmt::format("{}: {} made {} NaN from infinities: {} holds {}{}", kind, f.op, out->stats.nan,
                          with_inf->name, nonfinite_counts(with_inf->stats), zeros));
}

// Infinities that came in on purpose (a mask, allowed or written as a
// constant) gathered by a reduction into a result non-finite as a whole:
// the tracer makes such a finding a producer with non-finite inputs and an
// infinite, NaN-free output smaller than they are, which no arithmetic
// fault makes.
std::optional<diagnosis> gathered_mask(const finding& f) {
  const tensor_record* out = bad_output(f);
  if (f.role != role::producer || f.direction != direction::forward || !out || out->stats.nan > 0 ||
      out->stats.pos_inf + out->stats.neg_inf == 0)
    return std::nullopt;
  for (const auto& r : f.inputs)
    if (r.stats.pos_inf + r.stats.neg_inf > 0 && r.stats.nan == 0 && out->stats.numel < r.stats.numel)
      return make(cause::masked_infinity_reduced, confidence::high,
                  fmt::format("{} reduced the {} infinite entries of {} (a mask: {} of {}) into {} of {} outputs: it "
                              "read masked entries, as label smoothing does every class",
                              f.op, r.stats.pos_inf + r.stats.neg_inf, r.name, nonfinite_counts(r.stats),
                              r.stats.numel, nonfinite_counts(out->stats), out->stats.numel));
  return std::nullopt;
}

std::optional<diagnosis> log_domain(const finding& f) {
  const std::string op = base_name(f.op);
  if (!one_of(op, {"log", "log2", "log10", "log1p"}) || f.inputs.empty()) return std::nullopt;
  const tensor_stats& in = f.inputs[0].stats;
  const double pole = op == "log1p" ? -1 : 0;
  if (!(in.min <= pole)) return std::nullopt;
  if (op != "log1p" && in.min == 0) {
    const bool probabilities = in.max <= 1;
    const char* what = log_of_mask(f)       ? ": a 0/1 mask (log(0) = -inf where it is 0)"
                       : probabilities ? ": probabilities that underflowed to 0 (a softmax or sigmoid)"
                                       : "";
    return make(cause::log_of_nonpositive, confidence::high,
                fmt::format("{} of 0: {} of {} inputs are exactly 0 (smallest {}, largest {}){}", op, in.zeros,
                            in.numel, num(in.min), num(in.max), what));
  }
  return make(cause::log_of_nonpositive, confidence::high,
              fmt::format("{} of a value at or below {}: the smallest of {} inputs is {}", op, num(pole), in.numel,
                          num(in.min)));
}

std::optional<diagnosis> inverse_trig_domain(const finding& f) {
  const std::string op = base_name(f.op);
  if (!one_of(op, {"acos", "asin", "atanh"}) || f.inputs.empty()) return std::nullopt;
  const tensor_stats& in = f.inputs[0].stats;
  if (!(in.absmax >= 1)) return std::nullopt;
  return make(cause::inverse_trig_at_bound, confidence::high,
              fmt::format("{} of values at or beyond ±1: the largest |x| of {} inputs is {:.9g} (its domain is {})",
                          op, in.numel, in.absmax, op == "atanh" ? "(-1, 1)" : "[-1, 1]"));
}

bool in_normalisation(const finding& f) {
  for (const std::string* where : {&f.module, &f.caller, &f.forward_op, &f.node})
    for (const char* word : {"norm", "std", "var"})
      if (where->find(word) != std::string::npos) return true;
  return false;
}

// The sum of a tensor's elements, from its census.
double sum_of(const tensor_stats& s) { return s.mean * double(s.numel); }

bool whole(double v) { return std::isfinite(v) && std::abs(v - std::round(v)) < 1e-3; }

// A log of a 0/1 mask (an additive attention mask made with mask.log()):
// an input of 0s and 1s (its sum counts its non-zero elements), not one
// 1 per row as probabilities saturated by a softmax are.
bool log_of_mask(const finding& f) {
  if (!one_of(base_name(f.op), {"log", "log2", "log10"}) || f.inputs.empty()) return false;
  const tensor_record& in = f.inputs[0];
  const tensor_stats& s = in.stats;
  const int64_t ones = s.numel - s.zeros;
  const int64_t rows = in.shape.empty() ? 1 : s.numel / std::max<int64_t>(in.shape.back(), 1);
  return s.zeros > 0 && s.min == 0 && s.max == 1 && std::abs(sum_of(s) - double(ones)) < 0.5 && ones != rows;
}

// A binary division op ("div" of "aten::div_").
bool divides(const std::string& op) { return one_of(base_name(op), {"div", "true_divide", "divide"}); }

// 0/0 by a count (whole numbers, not all 0) outside a normalisation: a mean
// over a mask with nothing in a row ((x * mask).sum(1) / mask.sum(1)).
bool mean_over_empty_mask(const finding& f) {
  const tensor_record* out = bad_output(f);
  if (!divides(f.op) || f.inputs.size() != 2 || !out ||
      out->stats.nan == 0 || f.inputs[0].stats.zeros == 0 || in_normalisation(f))
    return false;
  const tensor_stats& count = f.inputs[1].stats;
  return count.zeros > 0 && count.zeros < count.numel && count.min >= 0 && whole(count.max) && whole(sum_of(count));
}

std::optional<diagnosis> zero_division(const finding& f) {
  const std::string op = base_name(f.op);
  const bool unary = one_of(op, {"reciprocal", "rsqrt"});
  if (!unary && !divides(op)) return std::nullopt;
  const tensor_record* out = bad_output(f);
  if (!unary && f.inputs.size() == 1) {  // a scalar divisor: not recorded
    return make(cause::division_by_zero, confidence::low,
                fmt::format("{} by a scalar made {} from {}: the divisor is not recorded; it is 0 or tiny", f.op,
                            out ? nonfinite_counts(out->stats) : "a non-finite value", census_line(f.inputs[0])));
  }
  const size_t d = unary ? 0 : 1;
  if (f.inputs.size() <= d || f.inputs[d].stats.zeros == 0) return std::nullopt;
  const tensor_stats& den = f.inputs[d].stats;
  const bool zero_over_zero = !unary && out && out->stats.nan > 0 && f.inputs[0].stats.zeros > 0;
  std::string note;
  if (in_normalisation(f))
    note += " in a normalisation (a constant feature or a batch of 1 has std 0, a zero vector norm 0)";
  else if (mean_over_empty_mask(f))
    note += ", a count with nothing in it (a mean over a mask that is all 0 in a row?)";
  if (low_precision(f.inputs[d].dtype)) note += fmt::format(" ({} flushes tiny values to 0)", f.inputs[d].dtype);
  return make(cause::division_by_zero, confidence::high,
              fmt::format("{}: {} of {} denominators ({}) are exactly 0{}", zero_over_zero ? "0/0" : "x/0", den.zeros,
                          den.numel, f.inputs[d].name, note));
}

// mean of nothing, var / std of one element (n - 1 = 0): 0/0 inside a reduction.
std::optional<diagnosis> reduction_of_too_few(const finding& f) {
  const std::string op = base_name(f.op);
  if (!one_of(op, {"mean", "var", "std", "var_mean", "std_mean"}) || f.inputs.empty()) return std::nullopt;
  const tensor_record* out = bad_output(f);
  if (!out || out->stats.nan == 0) return std::nullopt;
  const int64_t per_output = f.inputs[0].stats.numel / std::max<int64_t>(out->stats.numel, 1);
  const bool spread = op != "mean";
  if (per_output > (spread ? 1 : 0)) return std::nullopt;
  return make(cause::division_by_zero, confidence::high,
              spread ? fmt::format("{} over {} element per output with correction 1 divides by n - 1 = 0 (a batch "
                                   "of 1?)",
                                   op, per_output)
                     : std::string("mean of 0 elements is 0/0 (an empty batch or mask?)"));
}

// pow of 0 to a negative power (x/0), or of large bases. The exponent is
// not recorded when it is a scalar: medium confidence.
std::optional<diagnosis> power_overflow(const finding& f) {
  const std::string op = base_name(f.op);
  const tensor_record* out = bad_output(f);
  if (!one_of(op, {"pow", "float_power"}) || !out || f.inputs.empty() || out->stats.pos_inf + out->stats.neg_inf == 0)
    return std::nullopt;
  const tensor_stats& base = f.inputs[0].stats;
  if (base.zeros > 0)
    return make(cause::division_by_zero, confidence::medium,
                fmt::format("{} of 0 to a negative power: {} of {} bases are 0", op, base.zeros, base.numel));
  return make(cause::overflow, confidence::medium,
              fmt::format("{} of bases up to |x| = {} made {} (the largest {} is {})", op, num(base.absmax),
                          nonfinite_counts(out->stats), out->dtype, num(largest_finite(out->dtype))));
}

// The input beyond which `op` (exp, exp2, expm1, cosh, sinh) overflows a
// dtype whose largest value is `largest`.
double overflow_point(const std::string& op, double largest) {
  if (op == "exp2") return std::log2(largest);
  if (op == "cosh" || op == "sinh") return std::log(largest) + std::log(2.0);
  return std::log(largest);
}

// exp and friends past the dtype's largest value. In float16 a value
// float32 holds is a precision problem, not an overflow; bfloat16 has
// float32's range, so what passes it passes float32's too.
std::optional<diagnosis> exponential_overflow(const finding& f) {
  const std::string op = base_name(f.op);
  const tensor_record* out = bad_output(f);
  if (!one_of(op, {"exp", "exp2", "expm1", "cosh", "sinh"}) || !out || f.inputs.empty()) return std::nullopt;
  const tensor_stats& in = f.inputs[0].stats;
  const double x = (op == "cosh" || op == "sinh") ? in.absmax : in.max;
  const double reach = overflow_point(op, largest_finite(out->dtype));
  if (!(x > reach)) return std::nullopt;
  if (out->dtype == "Half" && x <= overflow_point(op, largest_finite("Float")))
    return make(cause::precision_range, confidence::high,
                fmt::format("{} of up to {} is beyond {}'s largest value {} ({} > {}); float32 holds it", op, num(x),
                            out->dtype, num(largest_finite(out->dtype)), num(x), num(reach)));
  return make(cause::overflow, confidence::high,
              fmt::format("{} of up to {}: beyond {}, where {} passes the largest {} ({}); {} of {} outputs "
                          "overflowed",
                          op, num(x), num(reach), op, out->dtype, num(largest_finite(out->dtype)),
                          out->stats.pos_inf + out->stats.neg_inf, out->stats.numel));
}

// A value past float16's range: a cast down, or arithmetic in it. Not
// bfloat16's: its range is float32's (largest 3.39e38 against 3.40e38), so
// a value beyond it grew beyond float32's too, an overflow (float_overflow;
// a divergence with the history before it), which no wider dtype fixes.
std::optional<diagnosis> half_overflow(const finding& f) {
  const tensor_record* out = bad_output(f);
  if (!out || out->dtype != "Half" || out->stats.pos_inf + out->stats.neg_inf == 0) return std::nullopt;
  for (const auto& r : f.inputs) {
    const int64_t beyond = r.stats.fp16_overflow;
    if (r.dtype != out->dtype && beyond > 0)
      return make(cause::precision_range, confidence::high,
                  fmt::format("cast to {}: {} of {} values of {} ({}) are beyond {} (largest |x| {})", out->dtype,
                              beyond, r.stats.numel, r.name, r.dtype, num(largest_finite(out->dtype)),
                              num(r.stats.absmax)));
  }
  return make(cause::precision_range, confidence::medium,
              fmt::format("{} in {} made {} from finite inputs (largest |x| {}): the result passes {}'s largest "
                          "value {}",
                          f.op, out->dtype, nonfinite_counts(out->stats), num(input_absmax(f)), out->dtype,
                          num(largest_finite(out->dtype))));
}

// Any other op whose finite inputs gave an infinity in float32, float64 or
// bfloat16.
std::optional<diagnosis> float_overflow(const finding& f) {
  const tensor_record* out = bad_output(f);
  if (!out || out->stats.pos_inf + out->stats.neg_inf == 0 || f.inputs.empty()) return std::nullopt;
  return make(cause::overflow, confidence::medium,
              fmt::format("{} made {} from finite inputs up to |x| = {} (the largest {} is {})", f.op,
                          nonfinite_counts(out->stats), num(input_absmax(f)), out->dtype,
                          num(largest_finite(out->dtype))));
}

diagnosis unclassified(const finding& f, const std::string& lead) {
  std::string evidence = lead;
  for (const auto* group : {&f.inputs, &f.outputs})
    for (const auto& r : *group) evidence += "; " + census_line(r);
  return make(cause::unclassified, confidence::low, evidence);
}

diagnosis diagnose_producer(const finding& f) {
  static const rule rules[] = {gathered_mask, backward_at_singularity, fully_masked_rows, nan_from_infinities, log_domain,
                               inverse_trig_domain,     zero_division,       reduction_of_too_few,
                               power_overflow,          exponential_overflow,  half_overflow};
  for (const rule& r : rules)
    if (auto d = r(f)) return *d;
  if (inputs_finite(f))
    if (auto d = float_overflow(f)) return *d;
  return unclassified(f, fmt::format("{} ({}) made {} and no class fits", f.op, to_string(f.direction),
                                     bad_output(f) ? nonfinite_counts(bad_output(f)->stats) : "a non-finite value"));
}

// A non-finite tensor that entered from outside the ops traced: the batch,
// or a parameter already bad.
diagnosis diagnose_input(const finding& f, const diagnosis_context& ctx) {
  const tensor_record* bad = nullptr;
  for (const auto& r : f.inputs)
    if (r.name == f.culprit || (!bad && !r.stats.all_finite())) bad = &r;
  const std::string counts = bad ? fmt::format("{} of {}", nonfinite_counts(bad->stats), bad->stats.numel) : "NaN/Inf";
  if (f.culprit.rfind("constant (", 0) == 0)  // the tracer's name of a number argument
    return make(cause::constant_in_model, confidence::high,
                fmt::format("{} of {} is the number {}, written in the model's code (not data, not a parameter)",
                            f.culprit, f.op, bad ? num(bad->stats.first_nonfinite_value) : "NaN/Inf"));
  if (f.culprit.rfind("input ", 0) == 0 && !ctx.data.empty())  // none of the named data, no parameter
    return make(cause::constant_in_model, confidence::medium,
                fmt::format("{} of {} held {} and is none of the data ({}) nor a parameter: a tensor the model's "
                            "code holds (a constant such as torch.tensor([...]), or a buffer)",
                            f.culprit, f.op, counts, fmt::join(ctx.data, ", ")));
  if (f.culprit.rfind("received via ", 0) == 0)  // the tracer's name of what a collective wrote
    return unclassified(f, fmt::format("the non-finite values were {} ({}): another rank sent them, and that rank's "
                                       "own trace names the op that made them",
                                       f.culprit, counts));
  if (names_data(f.culprit, ctx)) {
    // Rows are along the first dimension, as a batch's samples are.
    const int64_t per_row = bad && bad->shape.size() >= 2 && bad->shape[0] > 0 ? bad->stats.numel / bad->shape[0] : 0;
    std::string row;
    if (per_row > 0 && bad->stats.first_nonfinite_index >= 0)
      row = fmt::format(", the first in row {}", bad->stats.first_nonfinite_index / per_row);
    return make(cause::bad_data, f.culprit.rfind("input ", 0) == 0 ? confidence::medium : confidence::high,
                fmt::format("the non-finite values came in with {} ({}){}, not from an op", f.culprit, counts, row));
  }
  return unclassified(f, fmt::format("{} already held {} when {} read it (made before the traced ops, or written "
                                     "outside them)",
                                     f.culprit.empty() ? "an input" : f.culprit, counts, f.op));
}

// Values that flowed on from an earlier finding.
diagnosis diagnose_propagator(const finding& f) {
  if (auto d = nan_from_infinities(f)) return *d;
  return unclassified(f, fmt::format("{} carries non-finite values of {} from an earlier op: the first finding of "
                                     "the chain names where they were born",
                                     f.op, f.culprit.empty() ? "an input" : f.culprit));
}

// ------------------------------------------------------------ history

// A spike in the last few values of a series against those before them,
// scored as the sentinel scores its spikes (robust z); "" when none.
std::string spike_in(const std::vector<double>& series, const char* name) {
  constexpr size_t recent = 3, least = 5;
  if (series.size() < least + recent) return "";
  const spike_options defaults;
  spike_detector scores(spike_options().window(int64_t(series.size())).min_samples(int64_t(least)));
  double z = 0, value = 0;
  for (size_t i = 0; i < series.size(); ++i) {
    const double zi = scores.observe(series[i]);
    if (i + recent >= series.size() && zi > z) std::tie(z, value) = std::pair{zi, series[i]};
  }
  if (z <= defaults.threshold()) return "";
  return fmt::format("the {} rose to {} in the steps before (median {}, robust z {})", name, num(value),
                     num(detail::median({series.begin(), series.end() - recent})), num(z));
}

// Steady growth at the end of a series, too short for a spike's window: at
// least 3 rises in a row that multiplied it by 10 or more; "" when none.
std::string growth_in(const std::vector<double>& series, const char* name) {
  size_t rises = 0;
  while (rises + 1 < series.size() && series[series.size() - 1 - rises] > series[series.size() - 2 - rises]) ++rises;
  if (rises < 3) return "";
  const double from = series[series.size() - 1 - rises], to = series.back();
  if (!(to >= 10 * from)) return "";
  return fmt::format("the {} grew in each of the {} steps before, from {} to {}", name, rises, num(from), num(to));
}

// A parameter among the op's inputs grown past what training leaves a
// weight at: the weights diverged.
const tensor_record* huge_parameter(const finding& f, const diagnosis_context& ctx) {
  constexpr double kDiverged = 1e4;
  for (const auto& r : f.inputs)
    if (names_parameter(r.name, ctx) && r.stats.absmax > kDiverged) return &r;
  return nullptr;
}

// Evidence of divergence before the step: a gradient-norm or loss spike or
// steady growth, or a weight grown huge. "" when there is none.
std::string divergence_evidence(const finding& f, const diagnosis_context& ctx) {
  const std::string lr = ctx.lr > 0 ? fmt::format(" at lr {}", num(ctx.lr)) : "";
  for (const auto& [series, name] : {std::pair{&ctx.grad_norms, "grad norm"}, std::pair{&ctx.losses, "loss"}})
    for (const auto& rose : {spike_in, growth_in})
      if (std::string before = rose(*series, name); !before.empty()) return before + lr;
  if (const tensor_record* p = huge_parameter(f, ctx))
    return fmt::format("parameter {} reached |x| = {}{}: the weights diverged", p->name, num(p->stats.absmax), lr);
  return "";
}

}  // namespace

diagnosis diagnose(const finding& f, const diagnosis_context& ctx) {
  diagnosis d = f.role == role::input        ? diagnose_input(f, ctx)
                : f.role == role::propagator ? diagnose_propagator(f)
                                             : diagnose_producer(f);
  // A domain error (log, sqrt, acos, x/0, a mask) has its own fix whatever
  // came before; an overflow or an unexplained value is the divergence
  // showing after a spike, or under a loss scale the scaled gradients
  // passing float16's range.
  const bool overflowed =
      d.cause == cause::overflow || d.cause == cause::inf_arithmetic || d.cause == cause::unclassified;
  const std::string before = overflowed ? divergence_evidence(f, ctx) : "";
  if (!before.empty()) {
    d = make(cause::divergence, d.cause == cause::unclassified ? confidence::medium : confidence::high,
             before + "; then " + d.evidence);
  } else if (f.direction == direction::backward && ctx.loss_scale > 1 &&
             (overflowed || d.cause == cause::precision_range)) {
    if (d.cause != cause::precision_range) d = make(cause::precision_range, confidence::medium, d.evidence);
    d.evidence += fmt::format("; the gradients were scaled by {} (loss scaling)", num(ctx.loss_scale));
  }
  d.remedy = remedy_for(d.cause, f, ctx);
  return d;
}

const char* to_string(front_end e) { return kFrontEndNames[static_cast<int>(e)]; }

front_end front_end_from_string(const std::string& name) {
  return detail::enum_from_string(name, all_front_ends, "front_end");
}

}  // namespace nanguard
