import json,glob,statistics as st
res={}
for side in ("before","after"):
    for f in sorted(glob.glob(f"measurements/house-before-after/decode-{side}-*.json")):
        for r in json.load(open(f))["rows"]:
            res.setdefault((r["B"],r["method"]),{}).setdefault(side,[]).append((r["ratio_vs_hf"],r["decode_ratio_vs_hf"],r["tokens_per_s"]))
print("| B | method | ratio vs HF before (median; runs) | after | decode ratio before | after |")
print("|---|---|---|---|---|---|")
for (B,m),v in res.items():
    if m.startswith("HF"): continue
    b,a=v["before"],v.get("after",[])
    f=lambda xs,i: f"{st.median(x[i] for x in xs):.2f} ({', '.join(f'{x[i]:.2f}' for x in xs)})" if xs else "-"
    print(f"| {B} | {m} | {f(b,0)} | {f(a,0)} | {f(b,1)} | {f(a,1)} |")
