"""The layering rule of docs/architecture.md ("Rooms"), read from the code with tools/architecture.py: spire's
rooms form no cycle counting every import (inside functions too), nothing below the command line imports it, few
imports hide inside functions, the modules form no cycle, and the modules the doc calls torch-free load no torch."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import architecture  # noqa: E402  (tools/architecture.py)

MODS = architecture.read_modules()  # src/spire as it is (read once)


def _copy_src(tmp_path) -> Path:
    """src/spire's .py files copied under tmp_path, to mutate."""
    dst = tmp_path / "src" / "spire"
    shutil.copytree(architecture.SRC, dst, ignore=lambda d, names: [n for n in names if not n.endswith(".py")
                                                                     and not (Path(d) / n).is_dir()])
    return dst


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def test_the_code_keeps_the_layering_rule():
    problems = architecture.layering_problems(MODS)
    assert problems == [], "\n".join(problems)


def test_rooms_and_floors_are_read_from_the_code():
    mods = MODS
    edges = architecture.room_edges(mods)
    # known edges of today's code: the command line stands on top, the engine imports the drafts' protocol,
    # the model stands on the fast path, the registry on the defaults
    assert {"commands", "registry"} <= edges["cli"]
    assert "drafts" in edges["engine"] and "engine" not in edges["drafts"]
    assert "fastpath" in edges["model"] and "model" not in edges["fastpath"]
    floors = architecture.floors(mods)
    assert floors[0] == ["__main__"] and floors[1] == ["cli"] and floors[2] == ["commands"]
    where = {r: i for i, f in enumerate(floors) for r in f}
    assert all(where[t] > where[r] for r, ts in edges.items() for t in ts)  # every arrow points down
    assert {"errors", "defaults"} <= set(floors[-1])


@pytest.mark.parametrize("mutant, expect", [
    # an upward import inside a function: the registry (low) reaching the trainer (high) -> a cycle of rooms
    ("registry.py", "\n\ndef _up():\n    from spire.training import distill\n    return distill\n"),
    # an upward import at module level: the model importing the engine
    ("model.py", "\nimport spire.engine.engine  # noqa\n"),
    # a library module importing the command line
    ("data/sources.py", "\n\ndef _cli():\n    from spire.commands import options\n    return options\n"),
])
def test_an_upward_import_breaks_the_rule(tmp_path, mutant, expect):
    src = _copy_src(tmp_path)  # unchanged, it keeps the rule (test_the_code_keeps_the_layering_rule)
    _append(src / mutant, expect)
    problems = architecture.layering_problems(architecture.read_modules(src))
    assert problems, f"an upward import in {mutant} went unnoticed"
    if "commands" in expect:
        assert any("imports spire.commands.options of the top floor" in p for p in problems), problems
    else:
        assert any(p.startswith("rooms in a cycle") for p in problems), problems


def test_imports_inside_functions_are_counted(tmp_path):
    src = _copy_src(tmp_path)
    mods = architecture.read_modules(src)
    n = len({(m.rel, line) for m in mods.values() if m.room not in architecture.TOP_FLOOR for _, line in m.local})
    extra = architecture.MAX_LOCAL_IMPORTS - n + 1
    _append(src / "sampling.py", "".join(f"\n\ndef _local{i}():\n    from spire import params\n    return params\n"
                                         for i in range(extra)))
    problems = architecture.layering_problems(architecture.read_modules(src))
    assert any("imports inside functions outside the top floor" in p for p in problems), problems


def test_a_module_cycle_inside_a_room_breaks_the_rule(tmp_path):
    src = _copy_src(tmp_path)
    _append(src / "engine" / "output.py", "\n\ndef _back():\n    from spire.engine import engine\n    return engine\n")
    problems = architecture.layering_problems(architecture.read_modules(src))
    assert any(p.startswith("modules in an import cycle") and "spire.engine.output" in p for p in problems), problems


def test_torch_free_modules_load_no_torch():
    """Every module the doc lists as torch-free (a static reading) is imported in one fresh interpreter, which then
    holds no torch; the scheduler and the command line are among them, as the doc promises."""
    mods = MODS
    free = architecture.torch_free(mods)
    must = {"spire.cli", "spire.registry", "spire.params", "spire.serving.protocol", "spire.throughput.cost_model"}
    must |= {n for n in mods if "scheduler" in n.rsplit(".", 1)[-1]}
    assert must <= set(free), sorted(must - set(free))
    code = ("import importlib, sys\n"
            f"for name in {free!r}:\n    importlib.import_module(name)\n"
            "loaded = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
            "print(len(loaded))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0", "a module listed as torch-free loads torch"


def test_the_report_does_not_load_the_trainer():
    """evaluation/report.py reads the paper's numbers from spire.paper, not from the trainer (issue 54)."""
    mods = MODS
    seen, todo = set(), ["spire.evaluation.report"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += sorted(mods[m].loads)
    assert "spire.paper" in seen
    assert not any(m.startswith("spire.training") for m in seen)
