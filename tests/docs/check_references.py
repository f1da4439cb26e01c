#!/usr/bin/env python3
"""Every document the repository's files name is in the repository, with the sections they name.

A reader must be able to follow every pointer in the code, the command output, the tests and the
docs. Over every file git tracks (and new files it does not ignore), this checks:

  - a name ending in `.md` (`docs/theory.md`, `README.md`, `layer-gpu.md`) is a file of the
    repository: relative to the repository root, to the naming file's folder, or, for a bare name,
    in docs/;
  - a path under docs/ (`docs/img/rank-step-vs-batch.png`) exists;
  - in a Markdown file, a path that starts with `../` exists and stays inside the repository;
  - a section sign names a heading of the document it follows on the same line
    (`docs/theory.md §Coverage`, `docs/design.md §Numerics and their bounds`): the text after the
    sign starts with one of that document's headings, whole words. In a Markdown file a sign
    with no document before it on its line names a heading of the file itself.

    tests/docs/check_references.py [ROOT]        exit 1 and one line per broken reference
    tests/docs/check_references.py --self-test   checks the checker on a folder it writes
"""

import os
import re
import subprocess
import sys
import tempfile

SECTION = "\u00a7"
DOC = re.compile(r"(?<![\w./-])((?:\.\.?/)*(?:[\w.-]+/)*[\w-][\w.-]*\.md)(?!\w)")
DOCS_PATH = re.compile(r"(?<![\w./-])(docs/[\w./-]*\w)")
UP_PATH = re.compile(r"(?<![\w./$)}-])(\.\./[\w./-]*\w)")
URL = re.compile(r"\w+://\S+")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def repo_files(root):
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                             capture_output=True, check=True).stdout.decode()
        return sorted({f for f in out.split("\0") if f and os.path.isfile(os.path.join(root, f))})
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, dirs, names in os.walk(root):
            dirs[:] = [x for x in dirs if not x.startswith((".", "build")) and x != "__pycache__"]
            files += [os.path.relpath(os.path.join(d, n), root) for n in names]
        return sorted(files)


def read_text(path):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


class Checker:
    def __init__(self, root):
        self.root = os.path.realpath(root)
        self.headings = {}
        self.errors = []

    def resolve(self, name, file_dir):
        """The repository-relative path `name` points at, or None."""
        candidates = [os.path.join(file_dir, name), name]
        if "/" not in name:
            candidates.append(os.path.join("docs", name))
        for c in candidates:
            full = os.path.realpath(os.path.join(self.root, c))
            if full.startswith(self.root + os.sep) and os.path.exists(full):
                return os.path.relpath(full, self.root)
        return None

    def headings_of(self, doc):
        if doc not in self.headings:
            text = read_text(os.path.join(self.root, doc)) or ""
            fence = False
            found = []
            for line in text.split("\n"):
                if line.startswith("```"):
                    fence = not fence
                m = None if fence else HEADING.match(line)
                if m:
                    found.append(m.group(1))
            self.headings[doc] = found
        return self.headings[doc]

    def check_anchor(self, where, doc, anchor):
        for h in self.headings_of(doc):
            if anchor.startswith(h) and (len(anchor) == len(h) or not anchor[len(h)].isalnum()):
                return
        shown = anchor.strip()[:60]
        self.errors.append(f"{where}: '{SECTION}{shown}' names no heading of {doc} "
                           f"(its headings: {'; '.join(self.headings_of(doc)) or 'none'})")

    def check_file(self, rel):
        text = read_text(os.path.join(self.root, rel))
        if text is None:
            return
        file_dir = os.path.dirname(rel)
        is_md = rel.endswith(".md")
        for n, line in enumerate(text.split("\n"), 1):
            where = f"{rel}:{n}"
            urls = [m.span() for m in URL.finditer(line)]
            in_url = lambda pos: any(a <= pos < b for a, b in urls)
            docs = []  # (end position, resolved document) of each .md name on the line
            for m in DOC.finditer(line):
                if in_url(m.start()):
                    continue
                target = self.resolve(m.group(1), file_dir)
                if target is None:
                    self.errors.append(f"{where}: names '{m.group(1)}', which the repository does not contain")
                docs.append((m.end(), target))
            patterns = ((DOCS_PATH, "docs/ path"), (UP_PATH, "path")) if is_md else ((DOCS_PATH, "docs/ path"),)
            for pattern, what in patterns:
                for m in pattern.finditer(line):
                    if not in_url(m.start()) and not m.group(1).endswith(".md") and \
                            self.resolve(m.group(1), file_dir) is None:
                        self.errors.append(f"{where}: names the {what} '{m.group(1)}', which the repository "
                                           "does not contain")
            for m in re.finditer(SECTION + "([^" + SECTION + "]*)", line):
                before = [d for end, d in docs if end <= m.start()]
                if before:
                    doc = before[-1]
                elif is_md:
                    doc = rel
                else:
                    self.errors.append(f"{where}: '{SECTION}{m.group(1).strip()[:40]}' follows no document "
                                       "on its line")
                    continue
                if doc is not None:  # a missing document is reported above
                    self.check_anchor(where, doc, m.group(1))

    def run(self):
        for rel in repo_files(self.root):
            self.check_file(rel)
        return self.errors


def self_test():
    """Writes a small tree with good and broken references; the checker must report exactly the broken.

    The tree is written from templates: <D> stands for the docs folder, <M> for the Markdown
    suffix, <S> for the section sign and <U> for the parent folder, so that this file itself names
    nothing the repository lacks."""
    files = {
        "<D>a<M>": "# A\n\n## First part\n\nSee <S>First part, <D>b<M> <S>Second and <D>img/p.png.\n"
                   "Broken: <S>Nowhere, <D>b<M> <S>Secondary, <D>gone<M>, <D>img/q.png.\n",
        "<D>b<M>": "# B\n\n```\n## not a heading\n```\n\n## Second\n",
        "<D>img/p.png": "png",
        "src/x.cpp": "// <D>a<M> <S>First part; <D>b<M> <S>Second, <S>Second too\n"
                     "// PLANNING<M> <S>2 and <U>outside/notes.txt and https://example.org/c<M>\n"
                     "// a bare <S>First part\n// <D>b<M> <S>not a heading\n",
        "README<M>": "<D>a<M> and a<M> (a bare name found in <D>), <U>elsewhere/notes.txt\n",
    }
    want = [
        "<D>a<M>:6: '<S>Nowhere,",
        "<D>a<M>:6: '<S>Secondary,",
        "<D>a<M>:6: names '<D>gone<M>'",
        "<D>a<M>:6: names the <D> path '<D>img/q.png'",
        "src/x.cpp:2: names 'PLANNING<M>'",
        "README<M>:1: names the path '<U>elsewhere/notes.txt'",
        "src/x.cpp:3: '<S>First part' follows no document",
        "src/x.cpp:4: '<S>not a heading' names no heading of <D>b<M>",
    ]

    def fill(t):
        return t.replace("<D>", "docs/").replace("<M>", ".md").replace("<S>", SECTION).replace("<U>", "../")

    want = [fill(w) for w in want]
    with tempfile.TemporaryDirectory() as root:
        for name, text in files.items():
            path = os.path.join(root, fill(name))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(fill(text))
        got = Checker(root).run()
    missing = [w for w in want if not any(g.startswith(w) for g in got)]
    extra = [g for g in got if not any(g.startswith(w) for w in want)]
    for m in missing:
        print(f"self-test: not reported: {m}")
    for e in extra:
        print(f"self-test: reported, but fine: {e}")
    if missing or extra:
        return 1
    print(f"self-test: the {len(want)} broken references reported, nothing else")
    return 0


def main(argv):
    if argv[1:] == ["--self-test"]:
        return self_test()
    root = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    errors = Checker(root).run()
    for e in errors:
        print(e)
    if errors:
        print(f"{len(errors)} reference(s) to documents or sections the repository does not contain")
        return 1
    print("every document and section named in the repository exists")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
