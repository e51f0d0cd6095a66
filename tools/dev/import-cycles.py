#!/usr/bin/env python3
"""Print the import cycles between the modules of each Rust crate in the workspace.

A node is a file-level module: `src/lib.rs` (or `src/main.rs` when there is no lib.rs) is the
crate root, `src/a/b.rs` and `src/a/b/mod.rs` are the module `a::b`; inline modules (`mod tests
{ ... }`) belong to the file that holds them. Module A imports module B when A's file names a
path into B: `crate::b...`, `super::...`, `self::...`, or a child module of A by its bare name,
in a `use` item (brace groups expanded) or in an expression or type. A path is charged to the
longest module prefix it names, so `crate::group::view::View` is an edge to `group::view`.

A glob import (`use super::*`, `use crate::x::*`) is an edge to the module it imports from,
and it brings that module's names: where the importing file then says one of them, it depends
on the module behind the name. `use super::*` in `a/b.rs` that brings `a`'s `use c::Cell` is
an edge from `b` to its sibling `c` wherever `b` says `Cell`, as `use super::c::Cell` would be.
A name counts as said where it stands as a word outside comments and strings and is not a
field (`.cell`, `cell: ...`); a module's name only as the head of a path (`c::Cell`).

`main.rs` beside a lib.rs is a crate of its own and is skipped; a binary in a directory,
`src/bin/NAME/main.rs`, is a crate of its own and is checked as one.

A module naming one of its own ancestors (`use super::Core` in `group/view.rs`) is no edge: a
child module is part of its parent's implementation (it sees the parent's private items), so
the parent using it back is the layout Rust's privacy is built for, not a cycle to untangle.
The crate root is every module's ancestor, so crate-wide items there (ids, the error type)
make no edges either; a path through the root to a name it re-exports (`crate::Sigma`) is
charged to the module that defines it.

Every strongly connected component of more than one module is printed, per crate; the exit
code is 1 when there is any, so CI can keep the graph acyclic.

Usage: tools/dev/import-cycles.py [CRATE_DIR ...]   (default: every dir with Cargo.toml and src/)
"""

import os
import re
import sys

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip_comments_and_strings(text):
    """Blank out comments, string and char literals, keeping newlines and braces of code."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    if text[i] == "\n":
                        out.append("\n")
                    i += 1
        elif c == "r" and re.match(r'r#*"', text[i:i + 40]) and not re.match(r"\w", text[i - 1:i] or " "):
            m = re.match(r'r(#*)"', text[i:])
            end = text.find('"' + m.group(1), i + len(m.group(0)))
            end = n if end < 0 else end + 1 + len(m.group(1))
            out.append('""' + "\n" * text.count("\n", i, end))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'":
            # a char literal ('a', '\n', '\u{..}') or a lifetime ('a)
            m = re.match(r"'(\\[^']{1,10}|[^\\'])'", text[i:])
            if m:
                out.append("' '")
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def expand_use_tree(tree):
    """`a::{b, c::{d, e}}` -> [[a, b], [a, c, d], [a, c, e]] (globs and renames dropped)."""
    return [segs for segs, _ in expand_use_bindings(tree)]


def expand_use_bindings(tree):
    """`a::{b as x, c::*}` -> [([a, b], "x"), ([a, c], "*")]: each path with the name it binds,
    `*` for a glob (whose path is the module it imports from)."""
    tree = re.sub(r"\s+as\s+(" + IDENT + r")", r"=\1", tree)  # `x as y` -> `x=y`
    tree = re.sub(r"\s+", "", tree)

    def parse(s, prefix):
        paths = []
        depth, start, items = 0, 0, []
        for k, ch in enumerate(s):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                items.append(s[start:k])
                start = k + 1
        items.append(s[start:])
        for item in items:
            if not item:
                continue
            brace = item.find("{")
            if brace >= 0:
                head = [p for p in item[:brace].split("::") if p]
                paths.extend(parse(item[brace + 1:item.rfind("}")], prefix + head))
                continue
            item, _, rename = item.partition("=")
            segs = [p for p in item.split("::") if p]
            if segs[-1:] == ["*"]:
                paths.append((prefix + segs[:-1], "*"))
                continue
            if segs == ["self"]:
                segs = []
            full = prefix + segs
            bound = rename or (full[-1] if full else None)
            if bound == "self":
                bound = full[-2] if len(full) > 1 else None
            paths.append(([p for p in full if p != "self"] if full[-1:] == ["self"] else full, bound))
        return paths

    return parse(tree, [])


def crate_modules(src):
    """{module path tuple: file} for the crate rooted at src/lib.rs (or src/main.rs)."""
    root = "lib.rs" if os.path.exists(os.path.join(src, "lib.rs")) else "main.rs"
    modules = {}
    for dirpath, dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        parts = () if rel == "." else tuple(rel.split(os.sep))
        if parts[:1] == ("bin",):
            dirnames[:] = []
            continue
        for f in filenames:
            if not f.endswith(".rs"):
                continue
            if parts == () and f in ("lib.rs", "main.rs"):
                if f == root:
                    modules[()] = os.path.join(dirpath, f)
                continue
            name = f[:-3]
            mod = parts if name == "mod" else parts + (name,)
            modules[mod] = os.path.join(dirpath, f)
    return modules


def is_dir_module(path):
    return os.path.basename(path) in ("mod.rs", "lib.rs", "main.rs")


def reexports(path, modules):
    """{name: module} for the `pub use child::Name` items of the crate root: a path through
    the root to a re-exported name is charged to the module that defines it, since the root
    is only its façade."""
    text = strip_comments_and_strings(open(path, encoding="utf-8").read())
    names = {}
    for m in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]*);", text):
        tree = m.group(1)
        for segs in expand_use_tree(re.sub(r"\s+as\s+" + IDENT, "", tree)):
            if not segs:
                continue
            full = tuple(s for s in segs if s not in ("crate", "self"))
            for k in range(len(full) - 1, 0, -1):
                if full[:k] in modules:
                    names[full[-1]] = full[:k]
                    break
    return names


def scan_module(mod, path, modules, aliases):
    """What one file names: the modules its paths lead to, the names its top-level `use` items
    bind (name -> (module, is pub)), the modules it glob-imports (with the inline module the
    glob sits in), and every bare identifier it mentions."""
    text = strip_comments_and_strings(open(path, encoding="utf-8").read())
    children = {m[-1] for m in modules if len(m) == len(mod) + 1 and m[:len(mod)] == mod}
    # Inline modules shift what `super` and `self` mean: track them by brace depth.
    inline = []  # (name, depth at which its body opened)
    depth = 0
    targets = set()
    bindings = {}
    globs = set()

    def resolve(segs):
        here = mod + tuple(name for name, _ in inline)
        if not segs:
            return None
        if segs[0] == "crate":
            base, rest = (), segs[1:]
        elif segs[0] in ("super", "self"):
            base = here
            rest = list(segs)
            while rest and rest[0] in ("super", "self"):
                if rest.pop(0) == "super":
                    base = base[:-1]
        elif not inline and segs[0] in children:
            base, rest = mod, segs
        else:
            return None
        full = base + tuple(rest)
        if len(full) >= 1 and full[0] in aliases and full[:1] not in modules:
            return aliases[full[0]]
        for k in range(len(full), -1, -1):
            if full[:k] in modules:
                return full[:k]
        return None

    tokens = re.finditer(
        r"\b(pub(?:\([^)]*\))?\s+)?use\s+([^;]*);|\bmod\s+(" + IDENT + r")\s*\{|[{}]|\b((?:"
        + IDENT + r"::)+" + IDENT + ")",
        text,
    )
    for t in tokens:
        if t.group(2) is not None:
            tree = t.group(2)
            if tree.startswith("::"):
                continue
            for segs, bound in expand_use_bindings(tree):
                target = resolve(segs)
                if target is None:
                    continue
                targets.add(target)
                if bound == "*":
                    globs.add((target, mod + tuple(name for name, _ in inline)))
                elif bound and not inline:
                    names_module = target[-1:] == (segs[-1],) if segs[-1:] != ["self"] else True
                    bindings[bound] = (target, t.group(1) is not None, names_module)
        elif t.group(3) is not None:
            depth += 1
            inline.append((t.group(3), depth))
        elif t.group(0) == "{":
            depth += 1
        elif t.group(0) == "}":
            if inline and inline[-1][1] == depth:
                inline.pop()
            depth -= 1
        else:
            start = t.start(4)
            if start >= 2 and text[start - 2:start] == "::":
                continue
            target = resolve(t.group(4).split("::"))
            if target is not None:
                targets.add(target)
    for name in children:
        bindings.setdefault(name, (mod + (name,), False, True))
    # A module's name is only a use of it as the head of a path (`stream::Tracked`); alone it
    # is as likely a local variable (`let stream = ...`). A field (`.name`, `name: value`) is
    # no use of the function or constant of that name.
    words = set(re.findall(r"(?<![:\w.])" + IDENT + r"(?!\w)(?!\s*:(?!:))", text))
    heads = set(re.findall(r"(?<![:\w])(" + IDENT + r")\s*::", text))
    return {"targets": targets, "bindings": bindings, "globs": globs, "words": words, "heads": heads}


def glob_names(source, importer, scans, seen=()):
    """{name: module} that `use source::*` brings into `importer`: the names `source`'s own
    `use` items bind (all of them when `source` is `importer` or one of its ancestors, whose
    private items a descendant sees; only the `pub` ones otherwise), its child modules, and
    what its own glob imports bring, followed through."""
    if source not in scans or source in seen:
        return {}
    scan = scans[source]
    private_visible = importer[:len(source)] == source
    names = {}
    for glob_source, glob_here in scan["globs"]:
        if glob_here == source:
            names.update(glob_names(glob_source, importer, scans, seen + (source,)))
    for name, (target, public, names_module) in scan["bindings"].items():
        if public or private_visible:
            names[name] = (target, names_module)
    return names


def module_edges(mod, scans):
    """The modules `mod` imports. A glob import makes `mod` depend on the module it imports
    from, and on the module behind each name the glob brings that `mod` mentions: `use
    super::*` in `a/b.rs` that brings `a`'s `use c::Cell` makes `b` depend on its sibling `c`
    where `b` says `Cell`, just as `use super::c::Cell` would."""
    scan = scans[mod]
    targets = set(scan["targets"])
    for source, here in scan["globs"]:
        for name, (target, names_module) in glob_names(source, here, scans).items():
            used = scan["heads"] if names_module else scan["words"]
            if name in used and name not in scan["bindings"]:
                targets.add(target)
    return {t for t in targets if mod[:len(t)] != t}


def strongly_connected(graph):
    """Tarjan's algorithm, iterative; returns components in discovery order."""
    index, low, on_stack, stack, comps = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                comps.append(comp)
    return comps


def name(mod):
    return "crate" if not mod else "::".join(mod)


def crate_dirs(root):
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("target", ".git", "node_modules")]
        if "Cargo.toml" in filenames and os.path.isdir(os.path.join(dirpath, "src")):
            found.append(dirpath)
    return sorted(found)


def main(argv):
    here = os.path.dirname(os.path.abspath(__file__))
    workspace = os.path.dirname(os.path.dirname(here))
    dirs = argv[1:] or crate_dirs(workspace)
    any_cycle = False
    roots = []
    for d in dirs:
        src = os.path.join(d, "src")
        roots.append((d, src))
        bins = os.path.join(src, "bin")
        if os.path.isdir(bins):
            for b in sorted(os.listdir(bins)):
                if os.path.exists(os.path.join(bins, b, "main.rs")):
                    roots.append((os.path.join(bins, b), os.path.join(bins, b)))
    for d, src in roots:
        modules = crate_modules(src)
        if () not in modules:
            continue
        aliases = reexports(modules[()], modules)
        scans = {m: scan_module(m, p, modules, aliases) for m, p in modules.items()}
        graph = {m: module_edges(m, scans) for m in modules}
        cycles = [sorted(c) for c in strongly_connected(graph) if len(c) > 1]
        label = os.path.relpath(d, workspace)
        if not cycles:
            print(f"{label}: no cycles ({len(modules)} modules)")
            continue
        any_cycle = True
        for c in sorted(cycles):
            members = set(c)
            print(f"{label}: cycle of {len(c)} modules")
            for m in c:
                inside = sorted(name(t) for t in graph[m] if t in members)
                print(f"    {name(m)} -> {', '.join(inside)}")
    return 1 if any_cycle else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
