"""docs/architecture.md's generated sections ("Rooms" drawing, torch-free list, "Imports") are what
tools/architecture.py renders from src/spire now, and its "Modules" table names every module, so a room or module
left out of the doc fails here (run `make architecture` after changing imports)."""

import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import architecture  # noqa: E402  (tools/architecture.py)

MODS = architecture.read_modules()
DOC = architecture.DOC.read_text()


def _section(text: str, name: str) -> str:
    start = text.index(f"<!-- generated: {name} ")
    return text[start:text.index(f"<!-- end generated: {name} -->", start)]


def test_generated_sections_match_the_code():
    new = architecture.render_doc(DOC, MODS)
    for name in architecture.SECTIONS:
        assert _section(DOC, name) == _section(new, name), (
            f"docs/architecture.md's generated section {name!r} differs from the code: "
            "run `python tools/architecture.py --write` (make architecture)")


def test_every_room_is_drawn_and_every_module_listed():
    rooms = _section(DOC, "rooms")
    imports = _section(DOC, "imports")
    for room in {m.room for m in MODS.values()}:
        assert re.search(rf"(^|\s){re.escape(architecture.room_label(room, MODS))}(\s|$)", rooms, re.M), room
    for m in MODS.values():
        assert f"    {m.rel} ─► " in imports, m.rel


def test_a_room_left_out_of_the_doc_fails():
    """The doc with integrations/ taken out of both generated sections (as it was before issue 54) is stale."""
    stale = DOC
    for name in ("rooms", "imports"):
        sec = _section(DOC, name)
        cut = "\n".join(l for l in sec.split("\n") if "integrations/" not in l)
        cut = cut.replace("    integrations/", "")
        stale = stale.replace(sec, cut)
    assert stale != DOC
    new = architecture.render_doc(stale, MODS)
    assert _section(new, "rooms") != _section(stale, "rooms")
    assert _section(new, "imports") != _section(stale, "imports")


def test_a_new_module_changes_the_generated_sections(tmp_path):
    src = tmp_path / "src" / "spire"
    shutil.copytree(architecture.SRC, src, ignore=shutil.ignore_patterns("*.c", "__pycache__"))
    (src / "newroom").mkdir()
    (src / "newroom" / "__init__.py").write_text('"""A room nobody drew."""\nfrom spire import params\n')
    new = architecture.render_doc(DOC, architecture.read_modules(src))
    assert "newroom/" in _section(new, "rooms") and "newroom/" not in _section(DOC, "rooms")
    assert "    newroom/__init__.py ─► params.py" in _section(new, "imports")


def _module_table_names() -> set[str]:
    """The first column of the "Modules" table: each `name` in it (a module path or a room folder)."""
    table = DOC[DOC.index("\n## Modules"):]
    table = table[:table.index("\n## ", 1)]
    names = set()
    for line in table.splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(r"`([^`]+)`", line.split(" | ")[0]))
    return names


def test_the_modules_table_describes_every_module():
    """A module is described by its own row (`engine/runner.py`), or by its room's row (`throughput/`); a package
    `__init__.py` with nothing but a docstring needs no row."""
    names = _module_table_names()
    missing = []
    for m in MODS.values():
        folder = m.rel.split("/")[0] + "/" if "/" in m.rel else None
        if m.rel in names or (folder and folder in names):
            continue
        if m.path.name == "__init__.py" and len(m.path.read_text().strip().splitlines()) <= 3 and not m.loads:
            continue
        missing.append(m.rel)
    assert missing == [], f"modules without a row in docs/architecture.md's Modules table: {missing}"
