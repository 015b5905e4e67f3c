#!/usr/bin/env python3
"""check_layers.py -- every #include of fusion's sources stays within its layer or below.

The build writes build/layers.txt, one line per library made by fusion_library():

    NAME|include dirs|internal dirs|fusion libraries it links

(lists comma-separated). A source file belongs to the library whose include
directory is the longest prefix of its path; programs in tools/ and bench/
belong to a pseudo-library that links fusion_net and fusion_text, and tests/
may include anything. For every file the checker resolves each quoted
include -- beside the file first, then in the include directories -- and
reports:

  * upward:   the header belongs to a library the file's library does not link,
              directly or through the libraries below it;
  * internal: a *-impl.h header included from outside its own folder tree
              (tests excepted);
  * unknown:  a quoted include that resolves nowhere;
  * wire:     gRPC or protobuf headers, generated ones included, outside net/
              (tests and programs excepted).

Usage: check_layers.py --layers build/layers.txt --root SOURCE_DIR [--gen DIR]
Exit 0 when clean, 1 with one line per violation.
"""
import argparse
import os
import re
import sys

SOURCE_EXT = (".c", ".h", ".cu", ".cuh")
SKIP_DIRS = {".git", ".venv", "build", "tests"}
PROGRAM_DIRS = {"tools": ["fusion_net", "fusion_text"], "bench": ["fusion_net", "fusion_text"]}
INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
WIRE_SYSTEM_RE = re.compile(r"^(grpc|protobuf-c)/")


def read_layers(path):
    """-> {name: (include dirs, internal dirs, direct deps)}"""
    libs = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            name, inc, internal, deps = (line.split("|") + ["", "", ""])[:4]
            split = lambda s: [x for x in s.split(",") if x]
            libs[name] = (split(inc), split(internal), split(deps))
    return libs


def closure(libs, name):
    seen, todo = set(), [name]
    while todo:
        lib = todo.pop()
        if lib in seen or lib not in libs:
            continue
        seen.add(lib)
        todo.extend(libs[lib][2])
    return seen


class Tree:
    def __init__(self, libs, root):
        self.libs = libs
        self.root = os.path.realpath(root)
        self.dirs = []  # (dir, lib), longest first
        for name, (inc, internal, _) in libs.items():
            for d in inc + internal:
                self.dirs.append((os.path.realpath(d), name))
        self.dirs.sort(key=lambda x: -len(x[0]))
        for d, deps in PROGRAM_DIRS.items():
            libs["program:" + d] = ([], [], deps)

    def owner(self, path):
        path = os.path.realpath(path)
        rel = os.path.relpath(path, self.root)
        top = rel.split(os.sep)[0]
        if top == "tests":
            return "tests"
        if top in PROGRAM_DIRS:
            return "program:" + top
        for d, lib in self.dirs:
            if path == d or path.startswith(d + os.sep):
                return lib
        return None

    def resolve(self, src, header, lib):
        """The path `#include "header"` in src names, or None."""
        local = os.path.join(os.path.dirname(src), header)
        if os.path.isfile(local):
            return os.path.realpath(local)
        for d, _ in self.dirs:
            cand = os.path.join(d, header)
            if os.path.isfile(cand):
                return os.path.realpath(cand)
        return None


def top_folder(tree, path):
    return os.path.relpath(path, tree.root).split(os.sep)[0]


def check_file(tree, src):
    lib = tree.owner(src)
    if lib is None:
        return []
    allowed = None if lib == "tests" else closure(tree.libs, lib)
    text = open(src, errors="replace").read()
    rel = os.path.relpath(src, tree.root)
    out = []
    for m in INCLUDE_RE.finditer(text):
        kind, header = m.group(1), m.group(2)
        line = text.count("\n", 0, m.start()) + 1
        where = f"{rel}:{line}"
        if kind == "<":
            if WIRE_SYSTEM_RE.match(header) and lib not in ("fusion_net", "tests") and \
                    not lib.startswith("program:"):
                out.append(f"{where}: wire: <{header}> outside net/ ({lib})")
            continue
        path = tree.resolve(src, header, lib)
        if path is None:
            out.append(f'{where}: unknown: "{header}" resolves to no file of the tree')
            continue
        hlib = tree.owner(path)
        if header.endswith(".pb-c.h") and lib not in ("fusion_net", "tests") and \
                not lib.startswith("program:"):
            out.append(f'{where}: wire: "{header}" (generated protobuf) outside net/ ({lib})')
            continue
        if allowed is not None and hlib is not None and hlib not in allowed:
            out.append(f'{where}: upward: {lib} includes "{header}" of {hlib}')
        if os.path.basename(path).endswith("-impl.h") and lib != "tests" and \
                top_folder(tree, path) != top_folder(tree, src):
            out.append(f'{where}: internal: "{header}" is internal to {top_folder(tree, path)}/')
    return out


def sources(root):
    for d, subdirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        if rel == ".":
            subdirs[:] = [s for s in subdirs if s not in SKIP_DIRS]
        for f in sorted(files):
            if f.endswith(SOURCE_EXT):
                yield os.path.join(d, f)


def check(layers, root):
    tree = Tree(read_layers(layers), root)
    problems = []
    for src in sources(tree.root):
        problems += check_file(tree, src)
    return problems


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", required=True)
    ap.add_argument("--root", required=True)
    a = ap.parse_args(argv)
    problems = check(a.layers, a.root)
    for p in problems:
        print(p)
    n = sum(1 for _ in sources(os.path.realpath(a.root)))
    print(f"check_layers: {n} files, {len(problems)} violations")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
