"""The n-gram draft's lookup before a round: on the host over the scheduler's token ids (``host_source``, what the
engine runs, no read of the device) against the lookup on the device's token buffer (``match_sources``, what it ran
before, whose answer the policy then read back), in one process, alternated, medians.

    python benchmarks/ngram_lookup.py [-B 1,16] [-L 512,1536] [--reps 30] [--out measurements/ngram-lookup-cpu/ngram_lookup.json]

Each setting: B rows of L seeded random token ids from a 2,000-token vocabulary, each row ending in a 5-gram that
occurs earlier (so every row matches, as in a repetitive text); the default bounds n_min = n_max = 5. A timed
"round" is one lookup for all B rows: the host's reads each row's context from the runner's per-request state (a
numpy buffer of its tokens, ``RowState.context``, as ``Runner.proposes`` does) and sends the sources to a tensor; the device's includes writing the pending
token into a copy of the buffer and reading the (B,) answer back. Prints the median milliseconds of each and their
ratio. On a CPU the device read costs nothing; on a GPU it is a host sync per round, which the host lookup removes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import write_provenance  # noqa: E402

from spire.drafts.ngram import host_source, match_sources  # noqa: E402
from spire.engine.runner import RowState  # noqa: E402


def rows(B: int, L: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(B):
        r = [rng.randrange(2000) for _ in range(L)]
        at = rng.randrange(L // 2)
        r[-5:] = r[at: at + 5]
        out.append(r)
    return out


def host_round(states: list, reqs: list) -> list[bool]:
    """As ``Runner.proposes``: each row's context from its runner state (extended by what it emitted since), the
    lookup, the sources sent to a tensor."""
    found = [host_source(st.context(r), 5, 5) for st, r in zip(states, reqs)]
    torch.tensor(found, dtype=torch.int64)
    return [f >= 0 for f in found]


def device_round(buf: torch.Tensor, pos: torch.Tensor, tok: torch.Tensor) -> list[bool]:
    b = buf.clone()
    b[torch.arange(len(pos)), pos] = tok
    return (match_sources(b, pos, 5, 5, stop_early=False) >= 0).tolist()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-B", default="1,16")
    ap.add_argument("-L", default="512,1536")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for B in (int(x) for x in a.B.split(",")):
        for L in (int(x) for x in a.L.split(",")):
            ctx = rows(B, L)
            reqs = [SimpleNamespace(prompt=c[: L - 64], emitted=c[L - 64:]) for c in ctx]
            states = [RowState(torch.Generator()) for _ in ctx]
            buf = torch.tensor(ctx)
            pos, tok = torch.full((B,), L - 1), buf[:, -1].clone()
            assert host_round(states, reqs) == device_round(buf, pos, tok)
            times = {"host": [], "device": []}
            for i in range(a.reps):
                for name in (("host", "device") if i % 2 == 0 else ("device", "host")):
                    t = time.perf_counter()
                    host_round(states, reqs) if name == "host" else device_round(buf, pos, tok)
                    times[name].append(time.perf_counter() - t)
            h, d = (statistics.median(times[n]) * 1e3 for n in ("host", "device"))
            results.append({"B": B, "L": L, "host_ms": h, "device_ms": d, "host_over_device": h / d})
            print(f"B {B:3d}  L {L:5d}  host {h:7.3f} ms  device {d:7.3f} ms  host/device {h / d:5.2f}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"reps": a.reps, "results": results}, indent=2) + "\n")
        write_provenance(a.out.parent)


if __name__ == "__main__":
    main()
