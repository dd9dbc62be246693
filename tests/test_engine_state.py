"""docs/architecture.md's table "Engine state: one writer each" checked against the code with an `ast` walk of
src/spire (no torch, no model): every write to a piece of engine state sits in the writer the table names, and every
attribute the scheduler or the runner changes outside ``__init__`` is in the table."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "spire"
MUTATORS = {"append", "appendleft", "extend", "extendleft", "add", "insert", "pop", "popleft", "remove", "discard",
            "clear", "update", "setdefault", "fill_", "zero_", "copy_"}
ENGINE_EXPR = re.compile(r"\b(engine|runner|scheduler)\b")


def state_table(doc: str) -> tuple[dict[str, set[str]], set[str]]:
    """The table's rows: attribute name -> the writers allowed for it (a class, or Class.method), and the policy
    feedback's writers."""
    part = doc.split("<!-- engine state table: tests/test_engine_state.py -->", 1)[1]
    rows = [line for line in part.split("\n\n", 2)[1].splitlines() if line.startswith("| ") and "---" not in line]
    owners: dict[str, set[str]] = defaultdict(set)
    feedback: set[str] = set()
    for row in rows[1:]:  # the header first
        state, writers = row.split(" | ")[:2]
        named = set(re.findall(r"`([A-Za-z_][\w.]*)`", writers))
        if "policy.update" in state:
            feedback |= named
            continue
        for item in re.findall(r"`([A-Za-z_]\w*)\.(\w+)`", state):
            owners[item[1]] |= named
    return dict(owners), feedback


def writes(root: Path) -> list[tuple[str, str, str, str]]:
    """Every write to an attribute in src/spire: (file, enclosing Class.method or function, attribute, the written
    object's source). A write: ``x.a = ``, ``x.a[i] = ``, ``x.a += ``, ``x.a.append(...)`` (and the other mutators);
    calls of ``x.update`` / ``x.observe`` are reported as the attribute ``update`` / ``observe`` of x."""
    found = []
    for f in sorted(root.rglob("*.py")):
        rel = str(f.relative_to(root))

        def visit(node, where):
            for child in ast.iter_child_nodes(node):
                w = where
                if isinstance(child, ast.ClassDef):
                    w = child.name
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    w = f"{where}.{child.name}" if where and "." not in where else (where or child.name)
                targets = []
                if isinstance(child, ast.Assign):
                    for t in child.targets:
                        targets += t.elts if isinstance(t, ast.Tuple) else [t]
                elif isinstance(child, (ast.AugAssign, ast.AnnAssign)):
                    targets = [child.target]
                elif isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
                    if child.func.attr in MUTATORS:
                        targets = [child.func.value]
                    if child.func.attr in ("update", "observe"):
                        found.append((rel, w, child.func.attr, ast.unparse(child.func.value)))
                for t in targets:
                    while isinstance(t, ast.Subscript):
                        t = t.value
                    if isinstance(t, ast.Attribute):
                        found.append((rel, w, t.attr, ast.unparse(t.value)))
                visit(child, w)

        visit(ast.parse(f.read_text()), "")
    return found


def _in_scope(file: str, obj: str) -> bool:
    """Engine state lives in engine/ and serving/; elsewhere a write reaches it through an engine, runner or
    scheduler."""
    return file.startswith(("engine/", "serving/")) or bool(ENGINE_EXPR.search(obj))


def _allowed(where: str, writers: set[str]) -> bool:
    return where in writers or where.split(".")[0] in writers


def problems(root: Path, doc: str) -> list[str]:
    owners, feedback = state_table(doc)
    bad, seen = [], set()
    for file, where, attr, obj in writes(root):
        if attr in ("update", "observe") and "policy" in obj:
            if not _allowed(where, feedback):
                bad.append(f"{file}: {where} feeds the round policy ({obj}.{attr}); its writer is {sorted(feedback)}")
            continue
        if attr in owners and _in_scope(file, obj):
            seen.add(attr)
            if not _allowed(where, owners[attr]):
                bad.append(f"{file}: {where} writes {obj}.{attr}; its one writer is {sorted(owners[attr])}")
        if where.split(".")[0] in ("Scheduler", "Runner") and obj == "self" and not where.endswith("__init__") \
                and attr not in owners:
            bad.append(f"{file}: {where} changes self.{attr}, which the engine state table does not name")
    bad += [f"the table names {a}, which nothing in src/spire writes" for a in sorted(set(owners) - seen)]
    return bad


def test_each_piece_of_engine_state_has_the_one_writer_the_architecture_table_names():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    owners, feedback = state_table(doc)
    assert {"emitted", "prefilled", "slot", "requests", "n", "pending", "rounds", "prompt_tokens"} <= set(owners)
    assert feedback == {"Scheduler.update_from_output"}
    assert problems(SRC, doc) == []


def test_the_walk_finds_a_second_writer(tmp_path):
    """The check fails on code with a second writer: stats counted by the engine, a prefilled length set outside the
    scheduler, policy feedback from the engine, a runner attribute the table does not name."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "engine.py").write_text(
        "class Engine:\n"
        "    def _commit(self, req, plan):\n"
        "        st = self.stats\n"
        "        st.rounds += 1\n"
        "        req.prefilled = 3\n"
        "        self.scheduler.k_policy.observe([1], 2)\n")
    (tmp_path / "engine" / "runner.py").write_text(
        "class Runner:\n"
        "    def round(self):\n"
        "        self.scratch = 1\n"
        "        self.n[0] = 2\n")
    got = problems(tmp_path, doc)
    assert any("Engine._commit writes st.rounds" in p for p in got)
    assert any("Engine._commit writes req.prefilled" in p for p in got)
    assert any("Engine._commit feeds the round policy" in p for p in got)
    assert any("Runner.round changes self.scratch" in p for p in got)
    assert not any("self.n" in p and "writes" in p for p in got)  # the runner's own n
