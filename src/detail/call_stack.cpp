#include "detail/call_stack.h"

#include <torch/csrc/jit/runtime/interpreter.h>
#include <torch/csrc/profiler/combined_traceback.h>

#include <algorithm>
#include <optional>
#include <string_view>

namespace nanguard::detail {
namespace {

// True for a file under one of `directories`.
bool under_any(std::string_view file, const std::vector<std::string>& directories) {
  return std::any_of(directories.begin(), directories.end(),
                     [&](const std::string& dir) { return file.substr(0, dir.size()) == dir; });
}

// The function whose source holds `range`: the last `def NAME(` before it.
std::string enclosing_def(const torch::jit::SourceRange& range) {
  if (!range.source()) return "";
  const std::string text = range.source()->text_str().str();
  const size_t def = text.rfind("def ", std::min(range.start(), text.size()));
  if (def == std::string::npos) return "";
  const size_t name = def + 4, paren = text.find('(', name);
  return paren == std::string::npos ? "" : text.substr(name, paren - name);
}

// The line of TorchScript's frame `entry`: in the Python source it was
// scripted from, mapped back through a loaded model's debug information
// when it kept it; else in the model's serialized code. A subgraph the
// executor carved out of a function ("<forward op>" of a DifferentiableGraph,
// run once the model is optimised) is named by the function it came from.
source_location script_frame(const torch::jit::StackEntry& entry) {
  const std::optional<torch::jit::SourceRange> original = entry.range.findSourceRangeThatGenerated();
  const torch::jit::SourceRange& range = original ? *original : entry.range;
  const auto file_line = range.file_line_col();
  if (!file_line) return {};
  const auto& [file, line, column] = *file_line;
  return {file, int64_t(line), entry.filename.rfind('<', 0) == 0 ? enclosing_def(range) : entry.filename};
}

}  // namespace

call_stack capture_call_stack() {
  auto stack = std::make_shared<captured_stack>();
  stack->python = torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, /*cpp=*/false);
  stack->script = torch::jit::currentCallstack();
  return stack;
}

source_location user_frame(const call_stack& stack) {
  if (!stack) return {};
  const std::vector<std::string> skipped = library_paths();
  const auto users = [&](const source_location& where) { return where.known() && !under_any(where.file, skipped); };
  for (const torch::jit::StackEntry& entry : stack->script)
    if (source_location where = script_frame(entry); users(where)) return where;
  if (!stack->python) return {};
  const torch::SymbolizedTracebacks symbols = torch::symbolize({stack->python.get()});
  for (const uint64_t i : symbols.tracebacks.at(0)) {  // innermost first
    const torch::unwind::Frame& frame = symbols.all_frames.at(i);
    if (source_location where{frame.filename, int64_t(frame.lineno), frame.funcname}; users(where)) return where;
  }
  return {};
}

}  // namespace nanguard::detail
