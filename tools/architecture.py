"""spire's import structure read from the code, and the two generated sections of docs/architecture.md.

One job: an ``ast`` walk over ``src/spire`` that resolves every ``import`` statement (module level, inside
functions, under ``if TYPE_CHECKING``) to the spire modules it loads, and what follows from it:

- the rooms (the first name under ``src/spire``: a package such as ``drafts/`` or a module such as ``registry.py``)
  and the room graph, whose floors are drawn top floor first (:func:`floors`);
- the layering rule that tests/test_layers.py enforces (:func:`layering_problems`): the rooms form no cycle when
  every import counts, function-local ones included; the top floor (``cli.py``, ``commands/``, ``__main__.py``) is
  imported by no room below it; at most :data:`MAX_LOCAL_IMPORTS` spire-internal imports inside function bodies
  outside the top floor; the module graph has no cycle either;
- the text between the ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->`` markers of
  docs/architecture.md (sections ``rooms`` and ``imports``), which tests/test_architecture_doc.py compares with
  what this module renders from the code.

Run from the repository root (no torch needed, nothing of spire is imported)::

    python tools/architecture.py          # exit 1 and a diff when the doc's generated sections are stale
    python tools/architecture.py --write  # rewrite them in place (make architecture)
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "spire"
DOC = ROOT / "docs" / "architecture.md"

TOP_FLOOR = ("__main__", "cli", "commands")
"""The rooms of the top floor: the command line. Nothing below them imports them."""

MAX_LOCAL_IMPORTS = 5
"""At most this many spire-internal imports inside function bodies outside the top floor (`../shared/checks/
house-layers`' bound: a function-local import hides an edge of the graph from a reader of the module's head)."""

LEFT_OUT = ("errors",)
"""Modules left out of the generated import list as targets (nearly every module imports them; still counted by
the layering rule)."""

TORCH_MODULES = ("torch", "safetensors.torch", "accelerate")
"""Third-party imports that load torch, for :func:`torch_free` (a static reading; tests/test_layers.py checks the
modules it names by importing them)."""


@dataclass
class Module:
    """One module of src/spire: its dotted name, its path and the spire modules its imports resolve to."""

    name: str
    path: Path
    loads: set[str] = field(default_factory=set)  # module level, run when the module is loaded
    local: list[tuple[str, int]] = field(default_factory=list)  # (target, line) inside a function body
    typing: set[str] = field(default_factory=set)  # under `if TYPE_CHECKING:` only
    external: set[str] = field(default_factory=set)  # third-party modules imported at module level
    rel: str = ""  # the path relative to src/spire, as the doc writes it (``engine/engine.py``)

    @property
    def room(self) -> str:
        return room_of(self.name)


def room_of(name: str) -> str:
    """``spire.drafts.base`` → ``drafts``; ``spire`` (its ``__init__.py``) → ``__init__``."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def room_label(room: str, mods: dict[str, Module]) -> str:
    """How the doc names a room: ``drafts/`` for a package, ``registry.py`` for a module."""
    return f"{room}/" if any("/" in m.rel and m.room == room for m in mods.values()) else f"{room}.py"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.Module):
    """Every import statement of a module with where it sits: "load", "local" (in a function) or "typing"."""
    def walk(node, where):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, where
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                yield from walk(child, "local")
            elif isinstance(child, ast.If) and where == "load" and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), "typing")
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), "load")
            else:
                yield from walk(child, where)
    yield from walk(tree, "load")


@functools.lru_cache(maxsize=1024)
def _raw_imports(text: str) -> tuple:
    """The import statements of a module's source (cached by its text: the tests read mutated copies of src/spire,
    where one file differs): (where, is ``from``, module, level, names, line) each."""
    out = []
    for node, where in _import_nodes(ast.parse(text)):
        if isinstance(node, ast.Import):
            out.append((where, False, None, 0, tuple(a.name for a in node.names), node.lineno))
        else:
            out.append((where, True, node.module, node.level, tuple(a.name for a in node.names), node.lineno))
    return tuple(out)


def read_modules(src: Path = SRC) -> dict[str, Module]:
    """Every module under ``src`` (a ``spire`` package folder) with its imports resolved to spire modules.

    ``from a.b import c`` loads ``a.b`` and, when ``a.b.c`` is a module, that too; a relative import is resolved
    against the importing module's package; an import of a parent package of the importer is not counted.
    """
    base = src.parent
    mods = {}
    for f in sorted(src.rglob("*.py")):
        rel = f.relative_to(base).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        mods[name] = Module(name, f, rel=f.relative_to(src).as_posix())
    for m in mods.values():
        pkg = m.name if m.path.name == "__init__.py" else m.name.rsplit(".", 1)[0]
        for where, is_from, module, level, names, lineno in _raw_imports(m.path.read_text()):
            if not is_from:
                targets = list(names)
            else:
                mod = module or ""
                if level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - level + 1]
                    mod = ".".join(parts + ([mod] if mod else []))
                targets = [mod] + [f"{mod}.{a}" for a in names]
            for t in targets:
                if t.split(".")[0] != "spire":
                    if where == "load" and t:
                        m.external.add(t)
                    continue
                while t and t not in mods:
                    t = t.rsplit(".", 1)[0] if "." in t else ""
                if not t or t == m.name or m.name.startswith(t + "."):
                    continue
                if where == "load":
                    m.loads.add(t)
                elif where == "typing":
                    m.typing.add(t)
                elif (t, lineno) not in m.local:
                    m.local.append((t, lineno))
    for m in mods.values():
        m.typing -= m.loads
    return mods


def room_edges(mods: dict[str, Module]) -> dict[str, set[str]]:
    """Room → the rooms its modules import, every import counted (module level, in functions, type hints)."""
    edges: dict[str, set[str]] = {m.room: set() for m in mods.values()}
    for m in mods.values():
        for t in m.loads | m.typing | {t for t, _ in m.local}:
            if room_of(t) != m.room:
                edges[m.room].add(room_of(t))
    return edges


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, on, stack, comps, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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
            if len(comp) > 1:
                comps.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return comps


def layering_problems(mods: dict[str, Module]) -> list[str]:
    """What breaks the layering rule (module docstring), one line each; empty when the rule holds."""
    problems = []
    edges = room_edges(mods)
    below = {r: e for r, e in edges.items() if r not in TOP_FLOOR}
    for comp in cycles(below):
        problems.append("rooms in a cycle (every import counted): " + ", ".join(room_label(r, mods) for r in comp))
    for m in mods.values():
        if m.room in TOP_FLOOR:
            continue
        for t in sorted(m.loads | m.typing | {t for t, _ in m.local}):
            if room_of(t) in TOP_FLOOR:
                problems.append(f"{m.rel} imports {t} of the top floor (cli.py, commands/, __main__.py)")
    local = [f"{m.rel}:{line}" for m in mods.values() if m.room not in TOP_FLOOR for _, line in m.local]
    local = sorted(set(local))
    if len(local) > MAX_LOCAL_IMPORTS:
        problems.append(f"{len(local)} spire-internal imports inside functions outside the top floor "
                        f"(at most {MAX_LOCAL_IMPORTS}): {', '.join(local)}")
    graph = {m.name: set(m.loads) | set(m.typing) | {t for t, _ in m.local} for m in mods.values()}
    for comp in cycles(graph):
        problems.append("modules in an import cycle: " + ", ".join(comp))
    return problems


def floors(mods: dict[str, Module]) -> list[list[str]]:
    """The rooms by floor, top floor first: a room's floor is one above the highest floor it imports (a room that
    imports no other room is on the ground floor); ``__main__.py`` and ``cli.py`` stand above ``commands/``."""
    edges = room_edges(mods)
    height: dict[str, int] = {}

    def h(r, seen=()):
        if r not in height:
            if r in seen:
                raise ValueError(f"rooms in a cycle through {r}")
            height[r] = 1 + max((h(t, seen + (r,)) for t in edges[r]), default=-1)
        return height[r]

    for r in edges:
        h(r)
    out: dict[int, list[str]] = {}
    for r, n in height.items():
        out.setdefault(n, []).append(r)
    return [sorted(out[n], key=lambda r: (room_label(r, mods).endswith(".py"), r)) for n in sorted(out, reverse=True)]


def torch_free(mods: dict[str, Module]) -> list[str]:
    """The modules whose module-level imports (transitively, type hints not counted) load no torch, statically."""
    # a fixed point, not a memoized walk: a walk that skips the modules on its path would remember a submodule as
    # torch-free when only the package __init__.py it came from (a parent, so on its path) loads torch
    deps = {}
    for name, m in mods.items():
        # importing a module runs its parent packages' __init__.py first
        parents = {p for p in (name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)) if p in mods}
        deps[name] = (m.loads | parents) & set(mods)
    torch = {n for n, m in mods.items()
             if any(e == t or e.startswith(t + ".") for e in m.external for t in TORCH_MODULES)}
    grew = True
    while grew:
        more = {n for n in mods if n not in torch and deps[n] & torch}
        torch |= more
        grew = bool(more)
    return sorted(n for n in mods if n not in torch)


# ---------------------------------------------------------------------------------------------------- rendering

def _group(paths: list[str]) -> str:
    """``engine/engine.py``, ``engine/runner.py`` → ``engine/{engine,runner}.py`` (one folder's modules together;
    the modules at the top of src/spire each on its own)."""
    by_dir: dict[str, list[str]] = {}
    for p in paths:
        d, _, leaf = p.rpartition("/")
        if d:
            by_dir.setdefault(d, []).append(leaf[:-3])
        else:
            by_dir[p] = []
    parts = []
    for d, leaves in by_dir.items():
        if not leaves:
            parts.append(d)
        else:
            parts.append(f"{d}/{leaves[0]}.py" if len(leaves) == 1 else f"{d}/{{{','.join(leaves)}}}.py")
    return ", ".join(parts)


def _wrap(head: str, body: str, width: int = 116) -> list[str]:
    """``head`` then ``body`` broken at ", " to ``width`` columns, continuation lines under the body's start."""
    lines, line = [], head
    for i, piece in enumerate(body.split(", ")):
        piece = piece + ("," if i < body.count(", ") else "")
        if len(line) + 1 + len(piece) > width and line.strip() and line != head:
            lines.append(line)
            line = " " * len(head) + piece
        else:
            line = f"{line}{'' if line == head else ' '}{piece}"
    lines.append(line)
    return lines


def _module_order(mods: dict[str, Module]) -> list[Module]:
    """Rooms top floor first; within a room, each module before the modules it imports (ties by path)."""
    order = []
    for floor in floors(mods):
        for room in floor:
            inside = {n: m for n, m in mods.items() if m.room == room}
            deps = {n: {t for t in m.loads | m.typing | {t for t, _ in m.local} if t in inside} for n, m in inside.items()}
            depth: dict[str, int] = {}

            def d(n):
                if n not in depth:
                    depth[n] = 1 + max((d(t) for t in deps[n]), default=-1)
                return depth[n]

            order += sorted(inside.values(), key=lambda m: (-d(m.name), m.rel))
    return order


def _sorted_targets(mods: dict[str, Module], names, rank: dict[str, int]) -> list[str]:
    return [mods[n].rel for n in sorted(names, key=lambda n: rank[n]) if n.rsplit(".", 1)[-1] not in LEFT_OUT]


def render_rooms(mods: dict[str, Module]) -> str:
    """The floors drawing: the rooms of each floor on one line, top floor first, with the arrows between floors."""
    fl = floors(mods)
    lines = []
    for i, floor in enumerate(fl):
        lines.append("    " + "    ".join(room_label(r, mods) for r in floor))
        if i < len(fl) - 1:
            lines.append("        ▼")
    lines[-1] += "    (ground floor)"
    free_mods = set(torch_free(mods))
    rooms = sorted({m.room for m in mods.values()}, key=lambda r: room_label(r, mods))
    free = [r for r in rooms if all(n in free_mods for n, m in mods.items() if m.room == r)]
    lines += ["", "Loaded without torch (module-level imports, transitively, read statically; tests/test_layers.py imports",
              "each of them to check):", ""]
    lines += _wrap("    whole rooms: ", ", ".join(room_label(r, mods) for r in free))
    for room in rooms:
        if room in free:
            continue
        some = sorted(mods[n].rel.split("/", 1)[1] for n in free_mods if mods[n].room == room)
        if some:
            lines += _wrap(f"    in {room_label(room, mods)}: ", ", ".join(some))
    return "\n".join(lines)


def render_imports(mods: dict[str, Module]) -> str:
    """One entry per module, rooms top floor first: ``A ─► B, C`` (loaded with A), ``[in functions: ...]`` and
    ``[type hints: ...]``; a package ``__init__.py`` that imports nothing and a module that imports nothing are
    listed together at the end of their room."""
    lines = []
    current, was_alone = None, False
    order = _module_order(mods)
    rank = {m.name: i for i, m in enumerate(order)}
    for m in order:
        if m.room != current:
            alone = sum(1 for x in mods.values() if x.room == m.room) == 1
            if current is not None and not (alone and was_alone):
                lines.append("")
            current, was_alone = m.room, alone
        loads = _sorted_targets(mods, m.loads, rank)
        local = _sorted_targets(mods, {t for t, _ in m.local}, rank)
        typing = _sorted_targets(mods, m.typing, rank)
        head = f"    {m.rel} ─► "
        entry = _wrap(head, _group(loads) if loads else "nothing")
        for bracket in ([f"[in functions: {_group(local)}]"] if local else []) + (
                [f"[type hints: {_group(typing)}]"] if typing else []):
            if len(entry[-1]) + 4 + len(bracket) <= 116:
                entry[-1] += "    " + bracket
            else:  # on lines of its own, under the entry's first target
                entry += [" " * len(head) + line.lstrip() for line in _wrap(" " * len(head), bracket)]
        lines += entry
    local = sorted({(m.rel, line) for m in mods.values() if m.room not in TOP_FLOOR for _, line in m.local})
    per_file: dict[str, int] = {}
    for rel, _ in local:
        per_file[rel] = per_file.get(rel, 0) + 1
    names = [f"`{rel}`" + (f" ({n})" if n > 1 else "") for rel, n in per_file.items()]
    text = (f"Imports inside functions outside the top floor: {len(local)} (at most {MAX_LOCAL_IMPORTS}; "
            + (", ".join(names) if names else "none") + ").")
    return "\n".join([*textwrap.wrap(text, 116, break_on_hyphens=False), "", *(l.rstrip() for l in lines)])


SECTIONS = {"rooms": render_rooms, "imports": render_imports}
_MARK = re.compile(r"(<!-- generated: (\w+) \(python tools/architecture\.py --write\) -->\n)(.*?)(<!-- end generated: \2 -->)",
                   re.S)


def render_doc(text: str, mods: dict[str, Module]) -> str:
    """``text`` (docs/architecture.md) with each generated section replaced by what the code gives now."""
    found = set()

    def sub(match):
        name = match.group(2)
        if name not in SECTIONS:
            raise ValueError(f"unknown generated section {name!r} in {DOC.name}")
        found.add(name)
        return f"{match.group(1)}\n{SECTIONS[name](mods)}\n\n{match.group(4)}"

    out = _MARK.sub(sub, text)
    missing = set(SECTIONS) - found
    if missing:
        raise ValueError(f"{DOC.name} lacks the markers of the generated sections {sorted(missing)}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the generated sections of docs/architecture.md")
    args = ap.parse_args(argv)
    mods = read_modules()
    problems = layering_problems(mods)
    for p in problems:
        print(f"layering: {p}", file=sys.stderr)
    text = DOC.read_text()
    new = render_doc(text, mods)
    if args.write:
        if new != text:
            DOC.write_text(new)
            print(f"rewrote the generated sections of {DOC.relative_to(ROOT)}")
        return 1 if problems else 0
    if new != text:
        sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                                   "docs/architecture.md", "generated from src/spire"))
        print(f"{DOC.relative_to(ROOT)}: the generated sections differ from the code; "
              "run `python tools/architecture.py --write`", file=sys.stderr)
        return 1
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
