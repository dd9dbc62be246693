import re, glob, statistics as st
rows = {}
for side in ("before", "after"):
    for f in sorted(glob.glob(f"measurements/house-before-after/levers-{side}-*.txt")):
        for ln in open(f):
            m = re.match(r"^(\S.*?)\s{2,}(\d+)\s+(\d+)\s+([\d.]+)x$", ln.rstrip())
            if m:
                rows.setdefault(m.group(1), {}).setdefault(side, []).append((int(m.group(3)), float(m.group(4))))
print("| path | tokens/CPU-s before (runs) | after (runs) | x old path before (median; runs) | after |")
print("|---|---|---|---|---|")
for path, v in rows.items():
    f = lambda xs, i: f"{st.median(x[i] for x in xs):g} ({', '.join(f'{x[i]:g}' for x in xs)})"
    print(f"| {path} | {f(v['before'],0)} | {f(v['after'],0)} | {f(v['before'],1)} | {f(v['after'],1)} |")
