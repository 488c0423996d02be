#!/usr/bin/env python3
"""scripts/check-function-length on small C++ files: it must name a function
over the limit (file:line, name, length) and exit 1, pass one at the limit,
and read this codebase's shapes (constructors with member initializers,
lambdas, class and namespace scopes, braced initializers, strings and
comments holding braces) without losing track of where a function starts
and ends."""
import os
import subprocess
import sys
import tempfile
import unittest
from importlib.machinery import SourceFileLoader

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "check-function-length")
counter = SourceFileLoader("check_function_length", SCRIPT).load_module()


def body(lines):
    """`lines` statements, one a line."""
    return "".join(f"  x += {i};\n" for i in range(lines))


def lengths(text):
    """{name: lines} of the functions the counter finds in `text`."""
    return {name: last - first + 1 for first, last, name in counter.functions(text)}


class counts(unittest.TestCase):
    def run_on(self, text, *args):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "long.cpp")
            with open(path, "w") as f:
                f.write(text)
            return subprocess.run([sys.executable, SCRIPT, *args, path], capture_output=True, text=True)

    def test_a_function_over_the_limit_fails_naming_file_line_and_length(self):
        text = "#include <x>\n\nint small() { return 1; }\n\nvoid too_long(int x) {\n" + body(119) + "}\n"
        r = self.run_on(text)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertRegex(r.stdout, r"long\.cpp:5: too_long is 121 lines \(max 120\)")
        self.assertNotIn("small", r.stdout)

    def test_a_function_at_the_limit_passes(self):
        r = self.run_on("void at_limit(int x) {\n" + body(118) + "}\n")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("1 functions, none over 120 lines", r.stdout)

    def test_max_sets_the_limit(self):
        r = self.run_on("void f(int x) {\n" + body(8) + "}\n", "--max", "9")
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("f is 10 lines (max 9)", r.stdout)

    def test_the_shapes_of_this_codebase(self):
        # A function's first line is that of its declaration (a template's included).
        text = """
namespace nanguard {
namespace {
struct table {
  std::vector<int> v{1, 2};
  int size() const { return 2; }
};
const std::map<std::string, int> names = {{"a", 1}, {"b", 2}};
}  // namespace

class batch_source {
 public:
  batch_source(int a, int b)
      : rows_(a),
        cursor_{b} {
    if (a) {
      rows_ = 1;
    }
  }
  std::vector<int> next() const override {
    auto f = [&](int i) { return i; };
    return {f(1)};
  }
 private:
  int rows_, cursor_;
};

/* a comment with { braces */
std::string text(int x) {
  const char* s = "}}} { not code";
  return R"({"raw": }})" + std::string(s);  // }
}

template <typename F>
auto as_input_error(F&& fn) -> decltype(fn()) {
  return fn();
}

bool operator==(const table& a, const table& b) { return a.size() == b.size(); }

PYBIND11_MODULE(_nanguard, m) {
  m.def("f", [](int x) {
    return x;
  });
}
}  // namespace nanguard
"""
        self.assertEqual(lengths(text), {"size": 1, "batch_source": 7, "next": 4, "text": 4,
                                         "as_input_error": 4, "operator==": 1, "PYBIND11_MODULE": 5})


if __name__ == "__main__":
    unittest.main()
