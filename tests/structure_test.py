#!/usr/bin/env python3
"""scripts/check-structure on small synthetic trees: it must name a class
over the limit (file:line, name, length) and an include cycle between units
(a .cpp with its own header, beside it or in include/nanguard/), exit 1 for
each, and pass a tree whose units include one another one way only."""
import os
import subprocess
import sys
import tempfile
import unittest
from importlib.machinery import SourceFileLoader

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "check-structure")
checker = SourceFileLoader("check_structure", SCRIPT).load_module()


def members(n):
    """`n` member lines."""
    return "".join(f"  int m{i} = {i};\n" for i in range(n))


class structure(unittest.TestCase):
    def run_on(self, files, *args):
        """Runs the checker on a tree holding `files` ({path: text})."""
        with tempfile.TemporaryDirectory() as root:
            for path, text in files.items():
                os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
                with open(os.path.join(root, path), "w") as f:
                    f.write(text)
            return subprocess.run([sys.executable, SCRIPT, "--root", root, *args], capture_output=True, text=True)

    def test_a_class_over_the_limit_fails_naming_file_line_and_length(self):
        text = "#include <x>\n\nnamespace n {\nstruct small { int a; };\n\nstruct guard::impl {\n" + members(299) + "};\n}\n"
        r = self.run_on({"src/big.cpp": text})
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertRegex(r.stdout, r"src/big\.cpp:6: class guard::impl is 301 lines \(max 300\)")
        self.assertNotIn("small", r.stdout)

    def test_a_class_at_the_limit_passes_and_max_class_sets_the_limit(self):
        files = {"src/ok.h": "class at_limit {\n" + members(298) + "};\n"}
        r = self.run_on(files)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("1 classes, none over 300 lines", r.stdout)
        r = self.run_on(files, "--max-class", "100")
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("class at_limit is 300 lines (max 100)", r.stdout)

    def test_the_shapes_of_classes(self):
        text = """
namespace nanguard {
template <typename T>
struct kernel;
template <>
struct kernel<float> : base<float> {
  static int f() { struct local { int x; }; return 1; }
};
class tracer final : public observer {
 public:
  enum class kind { a, b };
  struct state;
  int g() const { return 2; }
};
union bits { float f; int i; };
struct alignas(64) padded {
  int x;
};
}
"""
        self.assertEqual({name: last - first + 1 for first, last, name in checker.classes(text)},
                         {"kernel": 4, "tracer": 6, "padded": 3})

    def test_a_source_calling_back_into_its_includer_is_a_cycle(self):
        # tracer.cpp includes findings.h; findings.cpp includes tracer.h: a circle of two units.
        files = {
            "include/nanguard/tracer.h": "#pragma once\n",
            "src/tracer/tracer.cpp": '#include "nanguard/tracer.h"\n\n#include "findings.h"\n',
            "src/tracer/findings.h": "#pragma once\n",
            "src/tracer/findings.cpp": '#include "findings.h"\n#include <nanguard/tracer.h>\n',
        }
        r = self.run_on(files)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("include cycle among units src/tracer/findings, src/tracer/tracer", r.stdout)
        self.assertIn("src/tracer/findings.cpp:2: includes include/nanguard/tracer.h", r.stdout)
        self.assertIn("src/tracer/tracer.cpp:3: includes src/tracer/findings.h", r.stdout)

    def test_a_private_header_including_its_users_public_header_is_a_cycle(self):
        # state.h includes the public header of the unit that includes it, through a third unit.
        files = {
            "include/nanguard/tracer.h": "#pragma once\n",
            "src/tracer.cpp": '#include "nanguard/tracer.h"\n#include "detail/deferred.h"\n',
            "src/detail/deferred.h": '#include "state.h"\n',
            "src/detail/state.h": '#include "nanguard/tracer.h"\n',
        }
        r = self.run_on(files)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("include cycle among units src/detail/deferred, src/detail/state, src/tracer", r.stdout)
        self.assertIn("src/detail/state.h:1: includes include/nanguard/tracer.h", r.stdout)

    def test_includes_one_way_pass(self):
        files = {
            "include/nanguard/census.h": '#pragma once\n#include <nanguard/stats.h>\n',
            "include/nanguard/stats.h": "#pragma once\n",
            "include/nanguard/tracer.h": "#pragma once\n#include <nanguard/census.h>\n",
            "src/census/census.cpp": '#include "nanguard/census.h"\n#include "paths.h"\n#include "detail/helper.h"\n',
            "src/census/paths.h": "#include <nanguard/stats.h>\n",
            "src/detail/helper.h": '#include "census/paths.h"\n',
            "src/tracer.cpp": '#include "nanguard/tracer.h"\n#include "detail/helper.h"\n// #include "nothing.h"\n',
        }
        r = self.run_on(files)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("no cycle", r.stdout)


if __name__ == "__main__":
    unittest.main()
