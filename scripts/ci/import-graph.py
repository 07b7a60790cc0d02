#!/usr/bin/env python3
"""File-level import graph of the workspace's crates: import circles and long files.

Walks each crate from its root (src/lib.rs, src/main.rs, src/bin/*.rs) through its `mod`
declarations (`#[path]` included), then resolves every `use crate::…`, `use super::…`,
`use self::…` (use trees with braces expanded), bare `crate::a::b` / `super::…` paths in
code, and paths that start with a child module's name, to the file of the longest module
prefix they name. An edge A -> B means a file A names something that lives in (or is
re-exported by) file B. Files that only declare a module (`mod x;`) do not depend on it.

Prints the strongly connected components of more than one file (the import circles), one
cycle path through each, and the files over the line limit. Exits 1 when there is a circle,
so it can gate a check. No dependencies beyond python3.

    scripts/ci/import-graph.py            # from the repository root
    scripts/ci/import-graph.py --edges    # also print every edge
    scripts/ci/import-graph.py --limit 800
"""

import argparse
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

CRATE_DIRS = [".", "collective", "kernels", "model", "serving", "launcher"]


def strip(src):
    """Source with comments, string and char literals blanked (newlines kept)."""
    out = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', src[i:i + 10]) and not _ident_before(src, i):
            m = re.match(r'r(#*)"', src[i:])
            end = src.find('"' + m.group(1), i + len(m.group(0)))
            j = n if end < 0 else end + 1 + len(m.group(1))
            out.append('""' + re.sub(r"[^\n]", " ", src[i + 2:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            j += 1
            out.append('""' + re.sub(r"[^\n]", " ", src[i + 2:j]))
            i = j
        elif c == "'":
            m = re.match(r"'(\\(x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^\\'])'", src[i:i + 16])
            if m:
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
            else:  # a lifetime
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _ident_before(src, i):
    return i > 0 and (src[i - 1].isalnum() or src[i - 1] == "_")


class Crate:
    def __init__(self, name, root_files):
        self.name = name
        self.files = {}  # file -> module path (tuple)
        self.modules = {}  # module path -> file
        self.children = defaultdict(set)  # module path -> child names
        self.items = defaultdict(set)  # module path -> names defined there
        self.reexports = defaultdict(dict)  # module path -> name -> (scope, segments)
        self.globs = defaultdict(list)  # module path -> [(scope, segments)] of `pub use x::*`
        for root in root_files:
            self._walk(root, (os.path.splitext(os.path.basename(root))[0],)
                       if "/bin/" in root else ())

    def _walk(self, path, modpath):
        if path in self.files or not os.path.exists(path):
            return
        self.files[path] = modpath
        self.modules[modpath] = path
        raw = Path(path).read_text(encoding="utf-8")
        text = strip(raw)
        depth = brace_depths(text)
        for m in ITEM_RE.finditer(text):
            scope = inline_scope(text, m.start())
            if depth[m.start()] == len(scope):
                self.items[modpath + scope].add(m.group(1))
        for m in USE_RE.finditer(text):
            if not m.group(1):
                continue
            scope = modpath + inline_scope(text, m.start())
            for segs, alias in expand_use(m.group(2), aliases=True):
                if segs[-1] == "*":
                    self.globs[scope].append((scope, segs[:-1]))
                else:
                    self.reexports[scope][alias or segs[-1]] = (scope, segs)
        for scope, name, attr_path, _pos in mod_decls(text, raw):
            child = modpath + scope + (name,)
            self.children[modpath + scope].add(name)
            if attr_path is not None:
                base = os.path.dirname(path)
                if scope or not is_mod_root(path):
                    base = os.path.join(base, *scope) if scope else base
                self._walk(os.path.normpath(os.path.join(base, attr_path)), child)
                continue
            base = os.path.dirname(path) if is_mod_root(path) else os.path.splitext(path)[0]
            base = os.path.join(base, *scope)
            for cand in (os.path.join(base, name + ".rs"), os.path.join(base, name, "mod.rs")):
                if os.path.exists(cand):
                    self._walk(os.path.normpath(cand), child)
                    break


def is_mod_root(path):
    b = os.path.basename(path)
    return b in ("mod.rs", "lib.rs", "main.rs") or "/bin/" in path


MOD_RE = re.compile(r"\b(?:pub(?:\s*\([^)]*\))?\s+)?mod\s+([A-Za-z_]\w*)\s*([;{])")
PATH_ATTR_RE = re.compile(r'#\[path\s*=\s*"([^"]+)"\]\s*$')


def mod_decls(text, raw):
    """(inline scope, name, #[path], position) for each `mod x;` / `mod x {` in a file."""
    decls = []
    for m in MOD_RE.finditer(text):
        scope = inline_scope(text, m.start())
        if m.group(2) == ";":
            before = raw[:m.start()].rstrip()
            # attributes may stack: look at the few lines above for #[path = "..."]
            attr = None
            for line in reversed(before.splitlines()[-4:]):
                line = line.strip()
                if not line.startswith("#["):
                    break
                pm = PATH_ATTR_RE.search(line)
                if pm:
                    attr = pm.group(1)
            decls.append((scope, m.group(1), attr, m.start()))
    return decls


_scope_cache = {}


def inline_scopes(text):
    """List of (start, end, name) spans of inline `mod name { … }` blocks."""
    key = id(text), len(text)
    if key in _scope_cache and _scope_cache[key][0] is text:
        return _scope_cache[key][1]
    spans = []
    for m in MOD_RE.finditer(text):
        if m.group(2) != "{":
            continue
        depth, j = 1, m.end()
        while j < len(text) and depth:
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
            j += 1
        spans.append((m.end(), j, m.group(1)))
    _scope_cache[key] = (text, spans)
    return spans


def inline_scope(text, pos):
    spans = [s for s in inline_scopes(text) if s[0] <= pos < s[1]]
    spans.sort()
    return tuple(s[2] for s in spans)


USE_RE = re.compile(r"(\bpub(?:\s*\([^)]*\))?\s+)?\buse\s+([^;]*);")
ITEM_RE = re.compile(
    r"\b(?:struct|enum|trait|fn|const|static|type|union|macro_rules!)\s+([A-Za-z_]\w*)")


def brace_depths(text):
    """Brace nesting depth at each position of the text."""
    out, d = [], 0
    for ch in text:
        if ch == "}":
            d -= 1
        out.append(d)
        if ch == "{":
            d += 1
    return out
PATH_RE = re.compile(r"(?<![\w:])((?:crate|super|self|[a-z_]\w*)(?:\s*::\s*[A-Za-z_]\w*)+)")


def expand_use(tree, aliases=False):
    """`a::{b, c::{d, e}}` -> [a::b, a::c::d, a::c::e] (as lists of segments); with
    `aliases`, pairs (segments, alias or None) for `x as y`."""
    tree = re.sub(r"\s+as\s+(\w+)", r"@\1", tree)
    tree = re.sub(r"\s+", "", tree)
    out = []
    for segs in _expand(tree):
        alias = None
        if segs and "@" in segs[-1]:
            segs[-1], alias = segs[-1].split("@", 1)
        out.append((segs, alias) if aliases else segs)
    return out


def _expand(t):
    i = t.find("{")
    if i < 0:
        return [[s for s in t.split("::") if s]]
    prefix = [s for s in t[:i].split("::") if s]
    depth, parts, cur = 0, [], ""
    for ch in t[i + 1:t.rfind("}")]:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    parts.append(cur)
    out = []
    for p in parts:
        if p:
            for tail in _expand(p):
                out.append(prefix + tail)
    return out


def resolve_item(crate, modpath, segs, hops=0):
    """File that holds what `segs` names from module `modpath`: the longest module prefix,
    then through that module's `pub use` re-exports to where the item is defined."""
    found = resolve(crate, modpath, segs, with_rest=True)
    if found is None:
        return None
    mod, rest = found
    if not rest or rest[0] in ("*", "self") or hops > 16:
        return crate.modules[mod]
    name = rest[0]
    if name in crate.items.get(mod, ()):
        return crate.modules[mod]
    if name in crate.reexports.get(mod, {}):
        scope, target = crate.reexports[mod][name]
        got = resolve_item(crate, scope, target + rest[1:], hops + 1)
        return got or crate.modules[mod]
    for scope, target in crate.globs.get(mod, ()):
        inner = resolve(crate, scope, target)
        if inner is None:
            continue
        if name in crate.items.get(inner, ()) or name in crate.reexports.get(inner, {}) \
                or (inner + (name,)) in crate.modules:
            got = resolve_item(crate, scope, target + rest, hops + 1)
            if got:
                return got
    return crate.modules[mod]


def resolve(crate, modpath, segs, with_rest=False):
    """Module path of the longest module prefix `segs` names from module `modpath`."""
    if not segs:
        return None
    segs = [s.replace("r#", "") for s in segs]
    if segs[0] == "crate":
        base, rest = (), segs[1:]
    elif segs[0] in ("super", "self"):
        base = list(modpath)
        rest = segs
        while rest and rest[0] in ("super", "self"):
            if rest[0] == "super":
                if not base:
                    return None
                base.pop()
            rest = rest[1:]
        base = tuple(base)
    elif segs[0] in crate.children.get(modpath, ()):
        base, rest = modpath, segs
    else:
        return None
    best = base if base in crate.modules else None
    used = 0
    cur = base
    for i, s in enumerate(rest):
        cur = cur + (s,)
        if cur in crate.modules:
            best, used = cur, i + 1
        elif cur not in crate.children.get(cur[:-1], ()) and s not in crate.children.get(cur[:-1], ()):
            break
    if with_rest:
        return None if best is None else (best, list(rest[used:]))
    return best


def edges_of(crate, strict=False):
    edges = defaultdict(set)
    for path, filemod in crate.files.items():
        raw = Path(path).read_text(encoding="utf-8")
        text = strip(raw)
        seen = []
        for m in USE_RE.finditer(text):
            if m.group(1):  # a re-export is followed, not counted
                continue
            scope = filemod + inline_scope(text, m.start())
            for segs in expand_use(m.group(2)):
                seen.append((scope, segs))
        masked = USE_RE.sub(lambda m: " " * len(m.group(0)), text)
        for m in PATH_RE.finditer(masked):
            scope = filemod + inline_scope(text, m.start())
            segs = re.sub(r"\s+", "", m.group(1)).split("::")
            seen.append((scope, segs))
        for scope, segs in seen:
            tfile = resolve_item(crate, scope, segs)
            if tfile is None:
                continue
            if tfile == path:
                continue
            # A module is made of its children: its using them is composition, not an
            # import (unless --strict). A child using its parent still counts.
            if not strict and is_descendant(crate.files[tfile], filemod):
                continue
            edges[path].add(tfile)
    return edges


def is_descendant(mod, ancestor):
    return len(mod) > len(ancestor) and mod[:len(ancestor)] == ancestor


def sccs(nodes, edges):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def cycle_in(comp, edges):
    """One shortest cycle through the component's first file."""
    members = set(comp)
    start = comp[0]
    prev = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, ())):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return list(reversed(path)) + [start]
                if w in members and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def crate_roots(d):
    roots = []
    for r in ("src/lib.rs", "src/main.rs"):
        if os.path.exists(os.path.join(d, r)):
            roots.append(os.path.normpath(os.path.join(d, r)))
    bindir = os.path.join(d, "src", "bin")
    if os.path.isdir(bindir):
        roots += [os.path.normpath(os.path.join(bindir, f))
                  for f in sorted(os.listdir(bindir)) if f.endswith(".rs")]
    return roots


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=1000, help="line limit per file (1000)")
    ap.add_argument("--edges", action="store_true", help="print every file edge")
    ap.add_argument("--strict", action="store_true",
                    help="also count a module's use of its own submodules")
    ap.add_argument("--root", default=".", help="repository root (.)")
    args = ap.parse_args()
    os.chdir(args.root)

    circles, long_files, nfiles = [], [], 0
    for d in CRATE_DIRS:
        roots = crate_roots(d)
        # each root is its own crate (lib, main binary, extra binaries)
        for root in roots:
            crate = Crate(d, [root])
            edges = edges_of(crate, args.strict)
            nfiles += len(crate.files)
            if args.edges:
                for a in sorted(edges):
                    for b in sorted(edges[a]):
                        print(f"edge {a} -> {b}")
            for comp in sccs(crate.files, edges):
                if len(comp) > 1:
                    circles.append((comp, cycle_in(comp, edges)))
            for f in crate.files:
                n = len(Path(f).read_text(encoding="utf-8").splitlines())
                if n > args.limit and (f, n) not in long_files:
                    long_files.append((f, n))

    print(f"{nfiles} files checked")
    if circles:
        print(f"{len(circles)} import circle(s):")
        for comp, cyc in circles:
            print(f"  {len(comp)} files: " + ", ".join(comp))
            print("    e.g. " + " -> ".join(cyc))
    else:
        print("no import circle between files")
    if long_files:
        print(f"{len(long_files)} file(s) over {args.limit} lines:")
        for f, n in sorted(long_files, key=lambda x: -x[1]):
            print(f"  {n:6} {f}")
    else:
        print(f"no file over {args.limit} lines")
    return 1 if circles else 0


if __name__ == "__main__":
    sys.exit(main())
