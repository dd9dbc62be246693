"""Medians over the rounds of ab.sh's runs: python summarize.py [RUNS_DIR] (default: ab-runs/ beside this file)."""
import collections
import glob
import json
import os
import statistics
import sys

root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "ab-runs")
rows = collections.defaultdict(list)
for f in glob.glob(os.path.join(root, "*", "bench.json")):
    code, w, k, _ = os.path.basename(os.path.dirname(f)).split("-")
    for row in json.load(open(f))["rows"]:
        rows[(w, int(k[1:]), row["draft"], code)].append(row)
print("| weights | k | draft | code | runs | t_AD ms | t_verify ms | verify / AD | t_draft ms | Δt | τ | AD tok/s "
      "| SD tok/s | SD / AD |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for key in sorted(rows, key=lambda t: (t[0] != "fp32", t[1], t[2], t[3] != "old")):
    rs = rows[key]

    def m(field):
        return statistics.median(r[field] for r in rs)

    print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {len(rs)} | {m('t_ad_s') * 1e3:.1f} | "
          f"{m('t_verify_s') * 1e3:.1f} | {m('t_verify_s') / m('t_ad_s'):.2f} | {m('t_draft_s') * 1e3:.1f} | "
          f"{m('delta_t_measured'):.2f} | {m('tau'):.2f} | {m('ad_tokens_per_s'):.1f} | {m('sd_tokens_per_s'):.1f} | "
          f"{m('multiplier_measured'):.2f} |")
