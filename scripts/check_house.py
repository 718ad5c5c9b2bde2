"""The house's limits, counted (CI runs this; docs/design.md, "The house's limits"):

- sizes: no package file over 700 lines, no class over 400, no function over 60;
- layers: the engine (``speedtorch_ops/training``) and what it builds on never import a front-end,
  and no ``csrc/`` feature folder includes one that includes it back;
- private calls across modules: ``x._name`` only where this file defines ``_name`` (or on the
  private ops, ``ops._*``, which are the package's own interface to its kernels);
- positions: no result read by position (``f(...)[1]``, ``x[k][2]``): a named tuple or a
  dataclass says what each part is;
- docstrings: every class a user imports (the ``__all__`` of the package, ``distributed`` and
  ``compat``) and every named part of the engine has "Args" and an "Example".

Tests and benches are left out. Prints each breach with its place and exits 1 if there is one.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "speedtorch_ops")
MAX_FILE, MAX_CLASS, MAX_FUNCTION = 700, 400, 60
# The front-ends: the engine and the layers under it import none of them.
FRONT_ENDS = ("modules", "collection", "capture", "compat", "distributed", "demo", "bags")
LOWER = ("training", "ops", "memory", "io", "jagged", "optim")
# Attributes on these names are another module's interface by design (torch's and NumPy's own
# underscored API, the package's private ops).
MODULES = {"ops", "_ops", "torch", "np", "F", "dist", "nn", "os", "sys"}
# A named tuple's own API.
NAMED_TUPLE = {"_replace", "_asdict", "_fields", "_make"}
# Calls whose results are positional by nature (an index's first hit, a sparse tensor's rows).
POSITIONAL = {"size", "split", "unbind", "chunk", "nonzero", "flatnonzero", "indices",
              "partition", "rpartition"}


def _py_files():
    for base, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(base, name)


def _sizes(path: str, tree: ast.Module, lines: int) -> list:
    out = []
    rel = os.path.relpath(path, ROOT)
    if lines > MAX_FILE:
        out.append(f"{rel}: {lines} lines (at most {MAX_FILE})")
    for node in ast.walk(tree):
        size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
        if isinstance(node, ast.ClassDef) and size > MAX_CLASS:
            out.append(f"{rel}:{node.lineno}: class {node.name} {size} lines (at most {MAX_CLASS})")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > MAX_FUNCTION:
            out.append(f"{rel}:{node.lineno}: function {node.name} {size} lines "
                       f"(at most {MAX_FUNCTION})")
    return out


def _module_of(path: str) -> list:
    return os.path.relpath(path, PACKAGE)[:-3].split(os.sep)


def _imports_up(path: str, tree: ast.Module) -> list:
    parts = _module_of(path)
    if parts[0] not in LOWER:
        return []
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 0:
            if not (node.module or "").startswith("speedtorch_ops"):
                continue
            target = (node.module or "").split(".")[1:]
        else:
            target = parts[:len(parts) - node.level] + (node.module or "").split(".")
        target = [t for t in target if t]
        names = target[:1] if target else [a.name for a in node.names]
        for name in names:
            if name in FRONT_ENDS:
                out.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: the engine's layer "
                           f"imports the front-end {name!r}")
    return out


def _defined(tree: ast.Module) -> set:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[-1])
    return names


def _private_calls(path: str, tree: ast.Module) -> list:
    own = _defined(tree)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__") or name in own | NAMED_TUPLE:
            continue
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and (root.id in MODULES or (
                root.id in {"self", "cls"} and isinstance(node.value, ast.Name))):
            continue
        out.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {ast.unparse(node)} is private "
                   "to another module")
    return out


def _positions(path: str, tree: ast.Module) -> list:
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, int) and not isinstance(node.slice.value, bool)):
            continue
        value = node.value
        func = value.func if isinstance(value, ast.Call) else None
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        call = func is not None and name not in POSITIONAL
        # x[k][2]: a tuple kept in a container; x["key"][0] is a record's list
        nested = isinstance(value, ast.Subscript) and not isinstance(value.slice, ast.Slice) \
            and not (isinstance(value.slice, ast.Constant) and isinstance(value.slice.value, str))
        if call or nested:
            out.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {ast.unparse(node)} reads "
                       "a result by position")
    return out


# The engine's named parts (training/): public classes a front-end builds on.
ENGINE_PARTS = {"RowEngine", "HostTable", "RowUpdate", "HostRows", "CachedRows", "Plan",
                "ColocatedRows"}


def _exported() -> set:
    """The names in the ``__all__`` of the package's public namespaces."""
    names = set()
    for sub in ("", "distributed", "compat"):
        tree = ast.parse(open(os.path.join(PACKAGE, sub, "__init__.py")).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                names |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
    return names


def _docstrings(trees: dict) -> list:
    wanted = _exported() | ENGINE_PARTS
    out = []
    for path, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name in wanted:
                doc = ast.get_docstring(node) or ""
                missing = [k for k in ("Args", "Example") if k not in doc]
                if missing:
                    out.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: class {node.name}'s "
                               f"docstring has no {' or '.join(missing)}")
    return out


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _csrc_cycles() -> list:
    """Feature folders of csrc/ that include each other (directly or through others)."""
    csrc = os.path.join(ROOT, "csrc")
    edges = defaultdict(set)
    for base, _, files in os.walk(csrc):
        for name in files:
            path = os.path.join(base, name)
            folder = os.path.relpath(base, csrc).split(os.sep)[0]
            with open(path, errors="replace") as f:
                text = f.read()
            for inc in _INCLUDE.findall(text):
                # Named from csrc/ (csrc/README.md), or else from the including file's folder.
                target = os.path.normpath(os.path.join(csrc, inc))
                if not os.path.exists(target):
                    target = os.path.normpath(os.path.join(base, inc))
                if not os.path.exists(target):
                    continue
                other = os.path.relpath(target, csrc).split(os.sep)[0]
                if other != folder and os.path.isdir(os.path.join(csrc, other)):
                    edges[folder].add(other)
    out = []
    for a in sorted(edges):
        seen, todo = set(), list(edges[a])
        while todo:
            b = todo.pop()
            if b == a:
                out.append(f"csrc/{a}/ includes a folder that includes it back")
                break
            if b not in seen:
                seen.add(b)
                todo.extend(edges.get(b, ()))
    return out


def main() -> int:
    breaches, trees = [], {}
    for path in _py_files():
        with open(path) as f:
            text = f.read()
        tree = trees[path] = ast.parse(text, path)
        breaches += _sizes(path, tree, text.count("\n") + 1)
        breaches += _imports_up(path, tree)
        breaches += _private_calls(path, tree)
        breaches += _positions(path, tree)
    breaches += _docstrings(trees)
    breaches += _csrc_cycles()
    for line in breaches:
        print(line)
    print(f"check_house: {len(breaches)} breach(es)" if breaches else "check_house: the house holds")
    return 1 if breaches else 0


if __name__ == "__main__":
    sys.exit(main())
