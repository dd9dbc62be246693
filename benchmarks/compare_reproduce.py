"""Two `spire reproduce` outputs of one commit side by side (issue 52, goal 3): every τ row of results.json, equal
round for round or not, with its CI in each; each draft's steps, tokens and minutes; and whether each draft's
trained weights (its run folder's .safetensors, the checkpoint left out) are bit-identical.

    python benchmarks/compare_reproduce.py RUN_A/spire-out RUN_B/spire-out [--cache-a DIR] [--cache-b DIR] \
        [--out measurements/.../comparison.txt]

--out: also write what it prints there, with the command, commit, machine and date beside it (provenance.json).
--cache-a / --cache-b: the SPIRE_CACHE each run used (results.json names run folders as ``<cache>/...`` once made
portable); without them the run folders are read as results.json names them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import write_provenance  # noqa: E402


def weights(run_dir: Path) -> dict[str, str]:
    """sha256 of each .safetensors under a run folder but its checkpoint/, by relative path."""
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*.safetensors")) if "checkpoint" not in p.relative_to(run_dir).parts}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--cache-a")
    ap.add_argument("--cache-b")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    lines: list[str] = []

    def say(line: str) -> None:  # printed, and kept for --out
        lines.append(line)
        print(line)

    res = [json.loads((p / "results.json").read_text()) for p in (args.a, args.b)]
    rows = [{(t["draft"], t["temperature"], t["L"], t["k"]): t for t in r["tau"]} for r in res]
    same = 0
    for key in sorted(rows[0], key=str):
        x, y = rows[0][key], rows[1].get(key)
        eq = y is not None and x["rounds"] == y["rounds"] and x["emitted"] == y["emitted"]
        same += eq
        other = "missing" if y is None else f"{y['tau']:.4f} [{y['ci_low']:.3f}, {y['ci_high']:.3f}]"
        say(f"{key[0]:9s} T={key[1]:g} L={key[2]} k={key[3]}  {x['tau']:.4f} [{x['ci_low']:.3f}, "
              f"{x['ci_high']:.3f}]  {other}  {'identical' if eq else 'DIFFERENT'}")
    say(f"{same}/{len(rows[0])} tau rows identical round for round")
    for kind, ta in res[0]["trainings"].items():
        tb = res[1]["trainings"].get(kind, {})
        say(f"{kind}: steps {ta.get('steps')} / {tb.get('steps')}, tokens {ta.get('tokens')} / {tb.get('tokens')}, "
              f"minutes {ta.get('elapsed_s', 0) / 60:.1f} / {tb.get('elapsed_s', 0) / 60:.1f}")
        dirs = [str(t.get("run_dir", "")).replace("<cache>", c) if c else str(t.get("run_dir", ""))
                for t, c in ((ta, args.cache_a), (tb, args.cache_b))]
        if all(Path(d).is_dir() for d in dirs):
            wa, wb = weights(Path(dirs[0])), weights(Path(dirs[1]))
            say(f"  weights: {'bit-identical' if wa and wa == wb else 'DIFFERENT'} ({len(wa)} files)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
        write_provenance(args.out.parent)


if __name__ == "__main__":
    main()
