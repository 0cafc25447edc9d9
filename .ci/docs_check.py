#!/usr/bin/env python3
"""Checks that the docs and the test tags say what the repository holds (Python 3, stdlib only).

Usage: python3 .ci/docs_check.py [--root DIR]

Prints one line per problem (`file:line: what`) and exits 1 when there is any, 0 otherwise.
The rules, as CONTRIBUTING.md ("Docs and tags that CI checks") states them:

  paths   A repository path cited in README.md, CONTRIBUTING.md, allocator/README.md or
          docs/*.md exists. Cited: a markdown link target, a whole `backtick` span that looks
          like a path (it contains a '/' or ends in a known extension), and, inside a backtick
          span or a fenced code block, each word that starts with a top-level folder of the
          repository (`tests/run.sh` in `bash tests/run.sh`). A link resolves against the
          citing file's folder; a backtick path against the repository root or the citing
          file's folder; a bare file name (`growth.cpp`) names a file somewhere in the tree.
          Left out: URLs, anchors, globs and placeholders (`*`, `<name>`, `{a,b}`, `NAME`,
          `...`), absolute paths, and build outputs (`build/...`, `build-*/...`).
  options Every key of the option table `k_options` in allocator/src/core/options/options.cpp
          has a row in the configuration table of docs/observability.md, and every row names a
          key.
  tags    Every tag of a TEST_CASE / TEMPLATE_TEST_CASE in tests/**/*.cpp is in CONTRIBUTING's
          tag list (a case id [Kn] is a heading of docs/cases.md); each case carries exactly
          one layer tag, its tags in the documented order; a case carries [gpu] exactly when
          its file name ends in _gpu.cpp or _gpu_test.cpp; every listed topic is used.
  issues  No source, test, script or doc but CHANGELOG.md names an issue number: the word
          issue followed by a number, a number after '#' in prose, a fixme tag with a number.
  map     Every file under allocator/src has a row in a table of allocator/README.md whose first
          cell names it (`src/core/blocks/block.hpp`).
  sizes   A core header (allocator/src/core/**/*.hpp) has at most 300 lines, a core .cpp 600.
  long    A function of the core has at most 60 lines, from its first line to its closing
          brace, unless the line before it says why: `// long: <reason>`.
"""

import argparse
import os
import re
import subprocess
import sys

DOCS = ["README.md", "CONTRIBUTING.md", "allocator/README.md"]  # and docs/*.md
# Folders a backtick path may be relative to, besides the repository root and the citing file's.
ROOTS = ["allocator", "allocator/include", "allocator/include/streamsafe", "allocator/src"]
SOURCE_EXTENSIONS = (".cpp", ".hpp", ".h", ".cu", ".cuh")
TEXT_EXTENSIONS = (".md", ".cpp", ".hpp", ".h", ".c", ".cu", ".cuh", ".py", ".sh", ".txt",
                   ".cmake", ".toml", ".yml", ".yaml", ".in")
LAYER, TOPIC, HARDWARE, CASES, SPEED = "layer", "topic", "hardware", "field cases", "speed"
CORE = "allocator/src/core/"
HEADER_LINES, SOURCE_LINES, FUNCTION_LINES = 300, 600, 60
MARKS = "marks"  # Catch2's own tags, such as [!shouldfail]
ORDER = [HARDWARE, LAYER, TOPIC, CASES, SPEED, MARKS]


# ---- a C++ function-extent scanner (for the `long` rule) --------------------------------------


def strip_code(text):
    """`text` with comments, string and character literals and preprocessor lines blanked out,
    newlines kept, so that offsets and line numbers are the source's."""
    out, i, n, line_start = [], 0, len(text), True
    while i < n:
        c = text[i]
        if line_start and c in " \t":
            out.append(c)
            i += 1
            continue
        j = None
        if line_start and c == "#":  # a preprocessor line and its continuations
            j = i
            while j < n and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j, n)
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        else:
            raw = re.match(r'R"([^()\\ ]{0,16})\(', text[i:i + 20])
            if raw and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
                end = text.find(")" + raw.group(1) + '"', i + raw.end())
                j = n if end < 0 else end + len(raw.group(1)) + 2
            elif c == "'" and 0 < i < n - 1 and text[i - 1].isalnum() and text[i + 1].isalnum():
                j = i + 1  # a digit separator: 1'000'000
            elif c in "\"'":
                j = i + 1
                while j < n and text[j] not in (c, "\n"):
                    j += 2 if text[j] == "\\" else 1
                j = min(j + 1, n)
        line_start = c == "\n"
        if j is None:
            out.append(c)
            i += 1
        else:
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            line_start = text[j - 1] == "\n" if j > i else line_start
            i = j
    return "".join(out)


SCOPE_HEAD = re.compile(r"^(template\s*<.*>\s*)?(inline\s+)?(namespace|class|struct|union|enum|"
                        r"extern)\b", re.S)
ACCESS = re.compile(r"^\s*(public|private|protected)\s*:\s*")
# What may follow a function's parameter list before its body: qualifiers, a trailing return
# type, annotation macros (STREAMSAFE_REQUIRES(mu_)).
TRAILER = re.compile(r"(\s+|\bconst\b|\bnoexcept\b(\s*\([^()]*\))?|\boverride\b|\bfinal\b|"
                     r"\bmutable\b|&&?|\b[A-Z][A-Z0-9_]*\b(\s*\([^()]*\))?|->[^;{}()]*)$")


def is_function_head(head):
    h = ACCESS.sub("", head).strip()
    if not h or SCOPE_HEAD.match(h) or re.match(r"(if|for|while|switch|catch|do|else|try)\b", h):
        return False
    if re.search(r"\)\s*(noexcept\s*)?:\s*[\w:<>]+\s*[({]", h):  # a constructor's initializers
        return True
    prev = None
    while prev != h:
        prev, h = h, TRAILER.sub("", h)
    return h.endswith(")")


def function_extents(text):
    """(first line, last line, name) of each function body that is not inside another function:
    free functions, member functions defined in or out of their class, lambdas at namespace
    scope. The first line is the first line of the declaration (template line included)."""
    code = strip_code(text)
    stack, head_start, found, start, name = [], 0, [], 0, "?"
    for i, c in enumerate(code):
        if c == ";" and (not stack or stack[-1] == "scope"):
            head_start = i + 1
        elif c == "{":
            if stack and stack[-1] != "scope":  # inside a body or an initializer
                stack.append("block" if stack[-1] in ("function", "block") else "init")
                continue
            head = code[head_start:i]
            if is_function_head(head):
                stack.append("function")
                access = ACCESS.match(head)
                start = head_start + (access.end() if access else len(head) - len(head.lstrip()))
                names = re.findall(r"([~\w:]+)\s*\(", head)
                name = names[0] if names else "?"
            elif SCOPE_HEAD.match(ACCESS.sub("", head).strip()):
                stack.append("scope")
                head_start = i + 1
            else:
                stack.append("init")
        elif c == "}" and stack:
            kind = stack.pop()
            if kind == "function":
                found.append((code.count("\n", 0, start) + 1, code.count("\n", 0, i) + 1, name))
            if kind in ("function", "scope"):
                head_start = i + 1
    return found


class Checker:
    def __init__(self, root):
        self.root = os.path.abspath(root)
        self.problems = []
        self.files = self._tracked_files()
        self.basenames = {os.path.basename(f) for f in self.files}
        self.dirs = set()
        for f in self.files:
            d = os.path.dirname(f)
            while d:
                self.dirs.add(d)
                d = os.path.dirname(d)
        self._entries = {}

    def _tracked_files(self):
        try:
            out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=self.root,
                                 capture_output=True, text=True, check=True).stdout
            if os.path.isdir(os.path.join(self.root, ".git")) or out:
                return sorted(f for f in out.splitlines()
                              if os.path.exists(os.path.join(self.root, f)))
        except (OSError, subprocess.CalledProcessError):
            pass
        files = []
        for top, dirnames, names in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if d != ".git" and not d.startswith("build")]
            for n in names:
                files.append(os.path.relpath(os.path.join(top, n), self.root))
        return sorted(files)

    def problem(self, path, line, what):
        self.problems.append(f"{path}:{line}: {what}")

    def read(self, rel):
        with open(os.path.join(self.root, rel), encoding="utf-8", errors="replace") as f:
            return f.read()

    def exists(self, rel):
        rel = os.path.normpath(rel)
        return rel in self.files or rel in self.dirs or (
            not rel.startswith("..") and os.path.exists(os.path.join(self.root, rel)))

    # ---- paths --------------------------------------------------------------------------------

    def doc_files(self):
        docs = [d for d in DOCS if d in self.files]
        docs += [f for f in self.files if re.fullmatch(r"docs/[^/]+\.md", f)]
        return docs

    def entries(self, root):
        """First path components of the tracked files under `root` ('' for the repository)."""
        if root not in self._entries:
            prefix = root + "/" if root else ""
            self._entries[root] = {f[len(prefix):].split("/", 1)[0] for f in self.files
                                   if f.startswith(prefix)}
        return self._entries[root]

    @staticmethod
    def skipped(token):
        return (not token or "://" in token or token.startswith(("#", "/", "~", "-", "mailto:"))
                or re.search(r"[*?<>{}\[\]$|=@,;()^]|\.\.\.|…", token)
                or re.search(r"\b[A-Z][A-Z0-9_]{2,}\b", token))  # a placeholder: NAME, BUILD_DIR

    def check_token(self, doc, n, token, link):
        token = token.strip("'\"").rstrip(".,:;")
        if link and token.startswith(("http:", "https:", "mailto:", "#")):
            return
        token = re.sub(r"#.*$", "", token)
        token = re.sub(r":\d+(-\d+)?$", "", token)  # file.cpp:172
        if self.skipped(token):
            return
        here = os.path.dirname(doc)
        if link:
            if not self.exists(os.path.join(here, token)):
                self.problem(doc, n, f"links to `{token}`, which does not exist")
            return
        token = re.sub(r"^(\./)+", "", token)
        first = token.split("/", 1)[0]
        roots = [r for r in dict.fromkeys(["", here] + ROOTS) if first in self.entries(r)]
        if roots:
            if not any(self.exists(os.path.join(r, token)) for r in roots):
                self.problem(doc, n, f"cites `{token}`, which does not exist")
        elif "/" not in token and token.endswith(SOURCE_EXTENSIONS) and token[0] != ".":
            if token not in self.basenames:
                self.problem(doc, n, f"cites the file `{token}`, which is nowhere in the tree")

    def check_paths(self):
        for doc in self.doc_files():
            fenced = False
            for n, line in enumerate(self.read(doc).splitlines(), 1):
                if line.lstrip().startswith("```"):
                    fenced = not fenced
                    continue
                if fenced:  # commands: words that start with a top-level folder
                    for w in line.split():
                        if "/" in w and w.split("/", 1)[0] in self.entries(""):
                            self.check_token(doc, n, w, False)
                    continue
                for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line):
                    self.check_token(doc, n, target, True)
                for span in re.findall(r"`([^`]+)`", line):
                    words = span.split()
                    if len(words) == 1:
                        self.check_token(doc, n, words[0], False)
                    else:
                        for w in words:
                            if "/" in w and w.split("/", 1)[0] in self.entries(""):
                                self.check_token(doc, n, w, False)

    # ---- options ------------------------------------------------------------------------------

    def check_options(self):
        src, ref = "allocator/src/core/options/options.cpp", "docs/observability.md"
        if src not in self.files or ref not in self.files:
            self.problem(src if src not in self.files else ref, 1, "missing: the options check "
                         "reads the table k_options and its reference table")
            return
        text = self.read(src)
        m = re.search(r"\bk_options\[\]\s*=\s*\{(.*?)\n\};", text, re.S)
        if not m:
            self.problem(src, 1, "no `k_options[] = {...};` table found")
            return
        start_line = text.count("\n", 0, m.start(1)) + 1
        keys = {}
        for km in re.finditer(r"^\s*\{\s*\"([a-z0-9_]+)\"", m.group(1), re.M):
            keys[km.group(1)] = start_line + m.group(1).count("\n", 0, km.start())
        documented = {}
        in_section = False
        for n, line in enumerate(self.read(ref).splitlines(), 1):
            if line.startswith("## "):
                in_section = line.strip() == "## Configuration"
                continue
            if in_section and line.startswith("| `"):
                first = line.split("|")[1]
                for key in re.findall(r"`([a-z0-9_]+)`", first):
                    documented[key] = n
        if not documented:
            self.problem(ref, 1, "no configuration table (rows '| `key` |') under "
                         "'## Configuration'")
        for key, line in sorted(keys.items()):
            if key not in documented:
                self.problem(src, line, f"option key `{key}` is not in the configuration table "
                             f"of {ref}")
        for key, line in sorted(documented.items()):
            if key not in keys:
                self.problem(ref, line, f"documented option key `{key}` is not a key of "
                             f"k_options in {src}")

    # ---- tags ---------------------------------------------------------------------------------

    def documented_tags(self):
        """{tag: class} from CONTRIBUTING.md's '## Test tags' section."""
        tags, cls, in_section = {}, None, False
        for n, line in enumerate(self.read("CONTRIBUTING.md").splitlines(), 1):
            if line.startswith("## "):
                in_section = line.strip() == "## Test tags"
                continue
            if not in_section:
                continue
            m = re.match(r"- \*\*([a-z ]+)\*\*", line)
            if m:
                cls = m.group(1).strip()
            if cls not in ORDER:
                continue
            for t in re.findall(r"`\[(!?[a-z0-9-]+)\]`", line):
                tags.setdefault(t, (cls, n))
        return tags

    def case_ids(self):
        if "docs/cases.md" not in self.files:
            return set()
        return set(re.findall(r"^## (K\d+)\b", self.read("docs/cases.md"), re.M))

    @staticmethod
    def test_cases(text):
        """(line, name, tags string) of each TEST_CASE / TEMPLATE_TEST_CASE / SCENARIO."""
        for m in re.finditer(r"\b(TEST_CASE|TEMPLATE_TEST_CASE|SCENARIO|TEST_CASE_METHOD)\s*\(",
                             text):
            line_start = text.rfind("\n", 0, m.start()) + 1
            before = text[line_start:m.start()].strip()
            if before.startswith(("//", "*", "#define")):
                continue
            args, cur, depth, i = [], [], 0, m.end()
            while i < len(text):
                c = text[i]
                if c == '"':
                    j = i + 1
                    while j < len(text) and text[j] != '"':
                        j += 2 if text[j] == "\\" else 1
                    cur.append(text[i + 1:j])
                    i = j + 1
                    continue
                if c in "([{":
                    depth += 1
                elif c in ")]}":
                    if depth == 0:
                        args.append("".join(cur))
                        break
                    depth -= 1
                elif c == "," and depth == 0:
                    args.append("".join(cur))
                    cur = []
                i += 1
            if m.group(1) == "TEST_CASE_METHOD":
                args = args[1:]
            line = text.count("\n", 0, m.start()) + 1
            yield line, (args[0] if args else ""), (args[1] if len(args) > 1 else "")

    def check_tags(self):
        if "CONTRIBUTING.md" not in self.files:
            self.problem("CONTRIBUTING.md", 1, "missing: the tag check reads its tag list")
            return
        listed = self.documented_tags()
        ids = self.case_ids()
        used = set()
        for f in self.files:
            if not (f.startswith("tests/") and f.endswith(".cpp")):
                continue
            gpu_file = re.search(r"_gpu(_test)?\.cpp$", f) is not None
            for line, name, tag_string in self.test_cases(self.read(f)):
                tags = re.findall(r"\[([^\]]*)\]", tag_string)
                classes = []
                for t in tags:
                    used.add(t)
                    if re.fullmatch(r"K\d+", t):
                        if t not in ids:
                            self.problem(f, line, f"tag [{t}] is not a case of docs/cases.md")
                        classes.append(CASES)
                    elif t in listed:
                        classes.append(listed[t][0])
                    else:
                        self.problem(f, line, f"tag [{t}] is not in CONTRIBUTING.md's tag list")
                layers = [t for t in tags if listed.get(t, ("",))[0] == LAYER]
                if len(layers) != 1:
                    self.problem(f, line, f"'{name[:60]}' carries {len(layers)} layer tags "
                                 f"({''.join('[' + t + ']' for t in layers) or 'none'}): "
                                 "exactly one is required")
                ranks = [ORDER.index(c) for c in classes]
                if ranks != sorted(ranks):
                    self.problem(f, line, f"tags {tag_string} are not in the documented order "
                                 "(hardware, layer, topic, cases, speed, marks)")
                if ("gpu" in tags) != gpu_file:
                    where = "a file not named *_gpu.cpp / *_gpu_test.cpp" if not gpu_file else \
                        "a _gpu file but lacks [gpu]"
                    self.problem(f, line, f"'{name[:60]}' is in {where}" if gpu_file else
                                 f"[gpu] case '{name[:60]}' is in {where}")
        for t, (cls, n) in sorted(listed.items()):
            if cls == TOPIC and t not in used:
                self.problem("CONTRIBUTING.md", n, f"topic tag [{t}] is listed but no test "
                             "carries it")

    # ---- the map of allocator/src ---------------------------------------------------------------

    def check_map(self):
        """Every file under allocator/src has a row in allocator/README.md's table."""
        readme = "allocator/README.md"
        sources = [f for f in self.files if f.startswith("allocator/src/")]
        if not sources:
            return
        if readme not in self.files:
            self.problem(readme, 1, "missing: it maps every file under allocator/src")
            return
        rows = set()
        for line in self.read(readme).splitlines():
            if not line.startswith("|"):
                continue
            first = line.split("|")[1]
            for span in re.findall(r"`([^`]+)`", first):
                span = span.strip()
                rows.add(span if span.startswith("allocator/") else "allocator/" + span)
        for f in sources:
            if f not in rows:
                self.problem(readme, 1, f"`{f[len('allocator/'):]}` has no row in the map of "
                             "allocator/src (a table row whose first cell names the file)")

    # ---- the core's sizes -------------------------------------------------------------------

    def core_sources(self):
        return [f for f in self.files if f.startswith(CORE) and f.endswith((".cpp", ".hpp"))]

    def check_sizes(self):
        for f in self.core_sources():
            limit = HEADER_LINES if f.endswith(".hpp") else SOURCE_LINES
            lines = self.read(f).count("\n")
            if lines > limit:
                self.problem(f, limit + 1, f"{lines} lines: a core {os.path.splitext(f)[1]} "
                             f"file has at most {limit}; split it by concern")

    def check_functions(self):
        for f in self.core_sources():
            text = self.read(f)
            lines = text.splitlines()
            for first, last, name in function_extents(text):
                if last - first + 1 <= FUNCTION_LINES:
                    continue
                before = lines[first - 2] if first >= 2 else ""
                if re.search(r"//\s*long:\s*\S", before):
                    continue
                self.problem(f, first, f"function `{name}` is {last - first + 1} lines (at most "
                             f"{FUNCTION_LINES}): split it, or give the reason on the line "
                             "before it as `// long: <reason>`")

    # ---- issue numbers ------------------------------------------------------------------------

    ISSUE = re.compile(r"\bissues?\s+#?\d+|\[fixme\d*\]|\bfixme\d+\b|(?:^|[\s(])#\d{1,5}\b(?![-:])",
                       re.I)

    def check_issue_numbers(self):
        for f in self.files:
            base = os.path.basename(f)
            if f == "CHANGELOG.md" or not (f.endswith(TEXT_EXTENSIONS) or base in (
                    "run", "CMakeLists.txt") or f.startswith(".ci/")):
                continue
            if "/corpus/" in f and f.startswith("tests/fuzz/"):
                continue
            try:
                text = self.read(f)
            except OSError:
                continue
            for n, line in enumerate(text.splitlines(), 1):
                m = self.ISSUE.search(line)
                if m:
                    self.problem(f, n, f"names an issue number ('{m.group(0).strip()}'): name "
                                 "the behaviour, or the K-case id of docs/cases.md")

    def run(self):
        self.check_paths()
        self.check_options()
        self.check_tags()
        self.check_issue_numbers()
        self.check_map()
        self.check_sizes()
        self.check_functions()
        return self.problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=os.path.join(os.path.dirname(__file__), ".."))
    args = parser.parse_args()
    problems = Checker(args.root).run()
    for p in problems:
        print(p)
    if problems:
        print(f"docs check: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print("docs check: paths, option keys, test tags, issue numbers, the map of allocator/src "
          "and the core's sizes agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
