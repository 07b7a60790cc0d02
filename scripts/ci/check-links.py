#!/usr/bin/env python3
"""Check the repository's markdown links: every relative link in README.md, docs/**/*.md
and scripts/**/*.md must resolve to a file or folder that a clone has, and no link may
leave the repository (../shared/..., /work/..., file://...).

    python3 scripts/ci/check-links.py            # from anywhere inside the repository
    python3 scripts/ci/check-links.py FILE.md    # only the files given

A link's target must be tracked by git (what a clone gets) when git is available, else it
must exist on disk. A link to a heading (`file.md#some-heading`, `#some-heading`) must
name a heading of that file, slugged as GitHub does. Paths in inline code that start with
`../` are reported too when they name nothing in the repository relative to the file and
leave it relative to the repository root: a command or a path a reader is told to
use must not point outside it. Web links (http, https, mailto) are not fetched.

Exit status 0 when everything resolves, 1 otherwise (each problem printed as
FILE:LINE: message). No dependencies beyond the Python 3 standard library.
"""

import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# [text](target "title") and ![alt](target); the target may be wrapped in <...>.
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]*)(?:\s+\"[^\"]*\")?\s*\)")
# [label]: target
REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def tracked_files():
    """The repository's tracked files (relative POSIX paths), or None without git."""
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z"],
            check=True,
            capture_output=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    files = {p for p in out.decode("utf-8", "surrogateescape").split("\0") if p}
    dirs = set()
    for f in files:
        parts = f.split("/")
        for i in range(1, len(parts)):
            dirs.add("/".join(parts[:i]))
    return files, dirs


def slug(text):
    """GitHub's heading anchor: formatting dropped, lower case, punctuation and symbols
    removed (letters, digits, '-', '_' and spaces kept), spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links: keep their text
    text = text.replace("`", "")
    text = re.sub(r"<[^>]+>", "", text)
    out = []
    for ch in text.lower():
        cat = unicodedata.category(ch)
        if ch in "-_ " or cat[0] in "LN" or cat == "Mn":
            out.append(ch)
    return "".join(out).replace(" ", "-")


def lines_outside_fences(text):
    """(line number, line) for every line not inside a fenced code block."""
    fence = None
    for n, line in enumerate(text.splitlines(), 1):
        m = re.match(r"^\s{0,3}(`{3,}|~{3,})", line)
        if m:
            marker = m.group(1)
            if fence is None:
                fence = marker
                continue
            if marker[0] == fence[0] and len(marker) >= len(fence):
                fence = None
                continue
        if fence is None:
            yield n, line


_anchor_cache = {}


def anchors_of(path):
    if path not in _anchor_cache:
        seen = {}
        anchors = set()
        text = path.read_text(encoding="utf-8", errors="replace")
        for _, line in lines_outside_fences(text):
            for a in HTML_ANCHOR.findall(line):
                anchors.add(a)
            m = HEADING.match(line)
            if not m:
                continue
            base = slug(m.group(2))
            k = seen.get(base, 0)
            seen[base] = k + 1
            anchors.add(base if k == 0 else f"{base}-{k}")
        _anchor_cache[path] = anchors
    return _anchor_cache[path]


def inside_repo(path):
    try:
        path.relative_to(ROOT)
        return True
    except ValueError:
        return False


class Checker:
    def __init__(self):
        self.tracked = tracked_files()
        self.problems = []

    def exists(self, path):
        rel = path.relative_to(ROOT).as_posix()
        if rel == ".":
            return True
        if self.tracked is None:
            return path.exists()
        files, dirs = self.tracked
        return rel in files or rel in dirs

    def report(self, md, n, msg):
        self.problems.append(f"{md.relative_to(ROOT).as_posix()}:{n}: {msg}")

    def check_target(self, md, n, target):
        if target.startswith("<") and target.endswith(">"):
            target = target[1:-1]
        if not target:
            self.report(md, n, "empty link target")
            return
        if SCHEME.match(target):
            scheme = target.split(":", 1)[0].lower()
            if scheme not in ("http", "https", "mailto"):
                self.report(md, n, f"link {target!r} leaves the repository ({scheme}:)")
            return
        path_part, _, anchor = target.partition("#")
        path_part = path_part.split("?", 1)[0]
        if path_part.startswith("/"):
            self.report(md, n, f"link {target!r} is an absolute path: it leaves the repository")
            return
        if path_part:
            dest = Path(os.path.normpath(md.parent / path_part))
            if not inside_repo(dest):
                self.report(md, n, f"link {target!r} leaves the repository")
                return
            if not self.exists(dest):
                where = "is not tracked by git" if dest.exists() else "does not exist"
                self.report(md, n, f"link {target!r}: {dest.relative_to(ROOT).as_posix()} {where}")
                return
        else:
            dest = md
        if (anchor and dest.suffix == ".md" and dest.is_file()
                and anchor not in anchors_of(dest)):
            self.report(md, n, f"link {target!r}: no heading with anchor #{anchor} in "
                        f"{dest.relative_to(ROOT).as_posix()}")

    def check_code_span(self, md, n, code):
        for word in re.split(r"[\s=(),;:'\"]+", code):
            if not word.startswith("../"):
                continue
            # A path relative to the file that names something in the repository is
            # fine; otherwise it is read as a command's path, run from the root.
            from_file = Path(os.path.normpath(md.parent / word))
            if inside_repo(from_file) and self.exists(from_file):
                continue
            if not inside_repo(Path(os.path.normpath(ROOT / word))):
                self.report(md, n, f"path {word!r} in inline code leaves the repository")

    def check_file(self, md):
        text = md.read_text(encoding="utf-8", errors="replace")
        for n, line in lines_outside_fences(text):
            for m in CODE_SPAN.finditer(line):
                self.check_code_span(md, n, m.group(2))
            bare = CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)
            for m in INLINE.finditer(bare):
                self.check_target(md, n, m.group(1))
            m = REFDEF.match(bare)
            if m:
                self.check_target(md, n, m.group(1))


def default_files():
    files = [ROOT / "README.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    files += sorted((ROOT / "scripts").rglob("*.md"))
    return [f for f in files if f.is_file()]


def main(argv):
    files = [Path(a).resolve() for a in argv] if argv else default_files()
    checker = Checker()
    for f in files:
        if not inside_repo(f):
            print(f"{f}: not inside the repository {ROOT}", file=sys.stderr)
            return 2
        checker.check_file(f)
    for p in checker.problems:
        print(p)
    shown = len(files)
    if checker.problems:
        print(f"check-links: {len(checker.problems)} problem(s) in {shown} file(s)", file=sys.stderr)
        return 1
    print(f"check-links: {shown} file(s), every relative link resolves inside the repository")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
