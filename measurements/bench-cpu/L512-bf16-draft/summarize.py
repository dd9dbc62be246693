"""Print every SPIRe row of the run folders (rR-kK-W/bench.json) and the median SD / AD per (k, draft weights).

    python measurements/bench-cpu/L512-bf16-draft/summarize.py [FOLDER]
"""
import collections
import json
import statistics
import sys
from pathlib import Path

folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
cells = collections.defaultdict(list)
print("run          t_AD ms  verify/AD  draft/AD  Δt    τ     AD tok/s  SD tok/s  SD/AD")
for f in sorted(folder.glob("r*-k*-*/bench.json")):
    for r in json.loads(f.read_text())["rows"]:
        if r["draft"] != "spire":
            continue
        run = f.parent.name
        print(f"{run:12s} {r['t_ad_s'] * 1e3:7.1f}  {r['t_verify_s'] / r['t_ad_s']:9.2f}  "
              f"{r['t_draft_s'] / r['t_ad_s']:8.2f}  {r['delta_t_measured']:4.2f}  {r['tau']:4.2f}  "
              f"{r['ad_tokens_per_s']:8.1f}  {r['sd_tokens_per_s']:8.1f}  {r['multiplier_measured']:5.3f}")
        cells[run.split("-", 1)[1]].append(r)
print("\nmedian over rounds: k, draft weights -> draft step / AD, SD / AD (each round)")
for key, rows in sorted(cells.items()):
    ratios = [r["multiplier_measured"] for r in rows]
    print(f"{key:10s} draft/AD {statistics.median(r['t_draft_s'] / r['t_ad_s'] for r in rows):.2f}  "
          f"SD/AD {statistics.median(ratios):.3f}  ({', '.join(f'{x:.3f}' for x in ratios)})")
