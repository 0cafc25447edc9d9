#!/usr/bin/env python3
"""Tests of .ci/docs_check.py: a small tree that passes, then one plant per rule, each of which
must fail with a line naming it. Run by ctest (docs_check_selftest) or directly."""

import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKER = os.path.join(HERE, "..", "..", ".ci", "docs_check.py")

TREE = {
    "README.md": "See [the design](docs/design.md) and `tests/core/a_test.cpp`; run "
                 "`bash .ci/run`; output under `build/tests/` and `<name>.json`.\n",
    ".ci/run": "#!/bin/sh\n",
    "CONTRIBUTING.md": """# Contributing

## Test tags

- **hardware**: `[gpu]`, `[multigpu]`.
- **layer** (exactly one):

  | tag | layer |
  | --- | --- |
  | `[core]` | the policy |
  | `[sim]` | the simulated device |

- **topic**:

  | tag | meaning |
  | --- | --- |
  | `[graph]` | graph capture |

- **field cases**: `[cases]` and the case id.
- **speed**: `[soak]`.

## Other
""",
    "docs/design.md": "The table: `allocator/src/core/options/options.cpp`, "
                      "`src/core/options/options.cpp` (from allocator/), `core/options.hpp` "
                      "(an include path).\n",
    "docs/observability.md": """# Observability

## Configuration

| key | values |
| --- | --- |
| `backend` | `cuda_malloc` |
| `memory_fraction`, `per_process_memory_fraction` | (0, 1] |

## Logging
""",
    "docs/cases.md": "# Cases\n\n## K1 - a case\n",
    "allocator/README.md": "| file | what it owns |\n| --- | --- |\n"
                           "| `src/core/options/options.cpp` | the options |\n"
                           "| `src/core/blocks/fit.cpp` | fit |\n\n"
                           "`include/streamsafe/core/options.hpp`\n",
    "allocator/src/core/blocks/fit.cpp": """// long: a table read in one pass (planted)
int table() {
""" + "  x();\n" * 70 + "}\n" + """struct s {
  int small() const noexcept { return 1; }
};
""",
    "allocator/include/streamsafe/core/options.hpp": "#pragma once\n",
    "allocator/src/core/options/options.cpp": """const option_spec k_options[] = {
    {"backend", "choice", "cuda_malloc, expandable",
     [](options& o, std::string_view v) {}},
    {"memory_fraction", "number", "", nullptr},
    {"per_process_memory_fraction", "number", "", nullptr},
};
""",
    "tests/core/a_test.cpp": """TEST_CASE("one", "[core][graph][cases][K1]") {}
TEST_CASE(
    "two, "
    "continued",
    "[sim][soak]") {}
""",
    "tests/backends/b_gpu_test.cpp": 'TEST_CASE("three", "[gpu][core]") {}\n',
}


class DocsCheckTest(unittest.TestCase):
    def run_on(self, changes):
        with tempfile.TemporaryDirectory() as root:
            files = dict(TREE)
            files.update(changes)
            for rel, text in files.items():
                if text is None:
                    continue
                path = os.path.join(root, rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
            r = subprocess.run([sys.executable, CHECKER, "--root", root], capture_output=True,
                               text=True, check=False)
            return r.returncode, r.stdout

    def fails_with(self, changes, *expected):
        rc, out = self.run_on(changes)
        self.assertEqual(rc, 1, out)
        for e in expected:
            self.assertIn(e, out)
        return out

    def test_clean_tree_passes(self):
        rc, out = self.run_on({})
        self.assertEqual(rc, 0, out)

    def test_stale_path(self):
        self.fails_with({"docs/design.md": TREE["docs/design.md"] + "See `tests/host_only/`.\n"},
                        "docs/design.md:2: cites `tests/host_only/`, which does not exist")

    def test_stale_link(self):
        self.fails_with({"README.md": "[gone](docs/gone.md)\n"},
                        "README.md:1: links to `docs/gone.md`, which does not exist")

    def test_undocumented_key(self):
        src = TREE["allocator/src/core/options/options.cpp"].replace(
            "};", '    {"planted_key", "number", "", nullptr},\n};')
        self.fails_with({"allocator/src/core/options/options.cpp": src},
                        "option key `planted_key` is not in the configuration table")

    def test_documented_key_that_does_not_exist(self):
        doc = TREE["docs/observability.md"].replace("\n## Logging", "| `gone_key` | 1 |\n\n## Logging")
        self.fails_with({"docs/observability.md": doc},
                        "documented option key `gone_key` is not a key of k_options")

    def test_unknown_tag(self):
        self.fails_with({"tests/core/c_test.cpp": 'TEST_CASE("x", "[core][planted-tag]") {}\n'},
                        "tests/core/c_test.cpp:1: tag [planted-tag] is not in CONTRIBUTING.md's")

    def test_unknown_case_id(self):
        self.fails_with({"tests/core/c_test.cpp": 'TEST_CASE("x", "[core][cases][K9]") {}\n'},
                        "tag [K9] is not a case of docs/cases.md")

    def test_layer_tags(self):
        self.fails_with({"tests/core/c_test.cpp": 'TEST_CASE("none", "[graph]") {}\n'
                                                  'TEST_CASE("two", "[core][sim]") {}\n'},
                        "'none' carries 0 layer tags", "'two' carries 2 layer tags")

    def test_tag_order(self):
        self.fails_with({"tests/core/c_test.cpp": 'TEST_CASE("x", "[graph][core]") {}\n'},
                        "are not in the documented order")

    def test_gpu_file_rule(self):
        self.fails_with({"tests/core/c_test.cpp": 'TEST_CASE("g", "[gpu][core]") {}\n',
                         "tests/core/d_gpu_test.cpp": 'TEST_CASE("h", "[core]") {}\n'},
                        "[gpu] case 'g' is in a file not named", "'h' is in a _gpu file")

    def test_unused_topic(self):
        self.fails_with({"tests/core/a_test.cpp": 'TEST_CASE("one", "[core]") {}\n'},
                        "topic tag [graph] is listed but no test carries it")

    def test_issue_numbers(self):
        word = "iss" + "ue"
        out = self.fails_with({"tests/core/c_test.cpp": f"// fixed in {word} 14 item 2\n",
                               "docs/design.md": TREE["docs/design.md"] + "See " + "#13.\n",
                               ".ci/run": "#!/bin/sh\nrun '~[" + "fixme" + "14]'\n",
                               "CHANGELOG.md": f"- {word} 13\n"},
                              "tests/core/c_test.cpp:1: names an issue number",
                              "docs/design.md:2: names an issue number",
                              ".ci/run:2: names an issue number")
        self.assertNotIn("CHANGELOG.md", out)


    def test_file_missing_from_the_map(self):
        self.fails_with({"allocator/src/core/blocks/pool.hpp": "#pragma once\n"},
                        "allocator/README.md:1: `src/core/blocks/pool.hpp` has no row in the map")

    def test_core_header_over_300_lines(self):
        self.fails_with({"allocator/src/core/blocks/big.hpp": "// x\n" * 301,
                         "allocator/README.md": TREE["allocator/README.md"] +
                         "\n| `src/core/blocks/big.hpp` | planted |\n"},
                        "allocator/src/core/blocks/big.hpp:301: 301 lines: a core .hpp file has at "
                        "most 300")

    def test_core_source_over_600_lines(self):
        self.fails_with({"allocator/src/core/options/options.cpp":
                         TREE["allocator/src/core/options/options.cpp"] + "// x\n" * 600},
                        "allocator/src/core/options/options.cpp:601: ")

    def test_long_function_without_a_reason(self):
        fit = TREE["allocator/src/core/blocks/fit.cpp"].replace(
            "// long: a table read in one pass (planted)\n", "// a plain comment\n")
        self.fails_with({"allocator/src/core/blocks/fit.cpp": fit},
                        "allocator/src/core/blocks/fit.cpp:2: function `table` is 72 lines (at "
                        "most 60)")

    def test_function_extents(self):
        sys.path.insert(0, os.path.dirname(CHECKER))
        import docs_check  # pylint: disable=import-outside-toplevel
        text = """namespace a {
// a comment with { and "
int f(int x) noexcept STREAMSAFE_REQUIRES(mu_) {
  auto s = "}{";
  char c = '}';
  if (x) {
    return 1'000;
  }
  return [&] { return 2; }();
}
struct t : base {
  t() : x_{1}, y_(2) {
  }
  int g() const { return x_; }
  int x_{0};
};
const int k[] = {1, 2};
}  // namespace a
"""
        self.assertEqual(docs_check.function_extents(text),
                         [(3, 10, "f"), (12, 13, "t"), (14, 14, "g")])


if __name__ == "__main__":
    unittest.main()
