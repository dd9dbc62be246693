"""spire's AD and SD (MagicDec) decoding against HF transformers ``generate`` on the same model, side by side.

    .venv/bin/python benchmarks/decode_vs_hf.py                      # B = 1 and 8, float32, 128-token prompts
    .venv/bin/python benchmarks/decode_vs_hf.py -B 1 -B 8 -L 128 -G 64 --repeats 3 --threads 2
    .venv/bin/python benchmarks/decode_vs_hf.py --vanilla-draft PATH  # + HF assisted generation at B = 1
    .venv/bin/python benchmarks/decode_vs_hf.py --device cuda --dtype bfloat16
    .venv/bin/python benchmarks/decode_vs_hf.py --weights both    # + weight-only bf16 rows (CPU, float32 math)

The model is SmolLM2-135M-Instruct from ``spire.loading.load_target()``; HF loads the converted
safetensors folder that call returns (``AutoModelForCausalLM.from_pretrained(folder)``), so both run the
same weights in the same dtype on the same device. Prompts are real held-out contexts of equal length
(``spire.data``), so no padding is involved. Greedy; every output is checked token by token against HF's.
Prints a table (tokens/s, ratio spire / HF, decode-only rates, identical) and optionally writes JSON.
See spire.bench.hf_compare for the method. Exit status 1 when an output differs from HF's in float32.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_provenance.py, under an older spire too
from _provenance import write_provenance  # benchmarks/_provenance.py


def random_pair(dtype: torch.dtype, device: torch.device, seed: int = 0):
    """(spire Transformer, HF LlamaForCausalLM) of SmolLM2-135M's shape sharing the same random weights, for
    machines without the real checkpoint (timings only: the text is noise, greedy identity still holds)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from spire.bench.run import SMOLLM2_CONFIG, random_target
    from spire.errors import ConfigError

    c = SMOLLM2_CONFIG
    target = random_target(torch.float32, "cpu", seed)
    hf_cfg = LlamaConfig(vocab_size=c["vocab_size"], hidden_size=c["d_model"], num_hidden_layers=c["n_layers"],
                         num_attention_heads=c["n_heads"], num_key_value_heads=c["n_kv_heads"], head_dim=c["d_head"],
                         intermediate_size=c["d_ff"], rope_theta=c["rope_theta"], rms_norm_eps=c["rms_eps"],
                         max_position_embeddings=c["max_positions"], tie_word_embeddings=True)
    hf = LlamaForCausalLM(hf_cfg)
    missing, unexpected = hf.load_state_dict(target.state_dict(), strict=False)
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise ConfigError(f"random pair: HF parameter names differ: {missing[:3]} {unexpected[:3]}")
    hf.tie_weights()
    return target.to(device=device, dtype=dtype), hf.to(device=device, dtype=dtype).eval()


def print_rows(rows: list[dict[str, Any]], title: str) -> None:
    """A rich table of the rows of :func:`spire.bench.hf_compare.compare`."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, caption="best of the interleaved repeats; ratio = tokens/s ÷ HF generate's at the "
                                       "same B; decode = without the prefill")
    for col in ("B", "method", "tok/s", "ratio", "decode tok/s", "decode ratio", "τ", "identical to HF"):
        table.add_column(col, justify="left" if col in ("method",) else "right")
    for r in rows:
        dec = r.get("decode_tokens_per_s")
        table.add_row(str(r["B"]), r["method"], f"{r['tokens_per_s']:.1f}", f"{r['ratio_vs_hf']:.2f}",
                      "-" if dec is None else f"{dec:.1f}",
                      "-" if r.get("decode_ratio_vs_hf") is None else f"{r['decode_ratio_vs_hf']:.2f}",
                      "-" if r["tau"] is None else f"{r['tau']:.2f}", "yes" if r["identical"] else "NO")
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-B", "--batch", type=int, action="append", help="batch size; repeatable (default 1 and 8)")
    ap.add_argument("-L", "--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    ap.add_argument("-G", "--new-tokens", type=int, default=64, help="tokens generated per row (default 64)")
    ap.add_argument("-k", type=int, default=4, help="draft tokens per round (default 4)")
    ap.add_argument("--window", type=int, default=64, help="MagicDec window (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved timed rounds; best is kept (default 3)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--weights", choices=["float32", "fp32", "bf16", "both"], default="float32",
                    help="bf16: weight-only bf16 on CPU (spire.fastpath.use_bf16_weights: spire streams bf16 weights "
                         "through its kernels, float32 arithmetic; HF runs the same rounded weights in float32); "
                         "both: float32 rows, then bf16 rows, in one run (default float32)")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default torch's)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--vanilla-draft", default=None, help="HF folder of a vanilla draft (B = 1 assisted rows)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall clock, or process CPU time (single-threaded CPU runs on a shared machine)")
    ap.add_argument("--random-weights", action="store_true",
                    help="SmolLM2-shaped random weights and random prompts (timings only; for machines without "
                         "the checkpoint, e.g. a GPU box)")
    a = ap.parse_args(argv)
    a.weights = "float32" if a.weights == "fp32" else a.weights  # spire's CLI spelling accepted too

    import torch
    from transformers import AutoModelForCausalLM

    from spire.bench.calibrate import resolve_device
    from spire.bench.hf_compare import HFCompareConfig, compare
    from spire.commands.bench import set_threads
    from spire.data import document_separator_id, prepare_data
    from spire.errors import ConfigError, SpireError
    from spire.loading import load_target

    try:
        for flag, value in (("-B", min(a.batch or [1])), ("-L", a.prompt_len), ("-G", a.new_tokens), ("-k", a.k),
                            ("--window", a.window), ("--repeats", a.repeats)):
            if value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")
        set_threads(a.threads)
        dev = resolve_device(a.device)
        dtype = getattr(torch, a.dtype)
        if a.weights != "float32" and (dtype != torch.float32 or dev.type != "cpu"):
            raise ConfigError("--weights bf16/both is weight-only bf16 for float32 models on the CPU "
                              "(leave --weights float32 with --dtype bfloat16)")
        cfg = HFCompareConfig(Bs=a.batch or [1, 8], L=a.prompt_len, G=a.new_tokens, k=a.k, window=a.window,
                              repeats=a.repeats, seed=a.seed, clock=a.clock)
        vanilla = hf_vanilla = None
        if a.random_weights:
            target, hf = random_pair(dtype, dev, a.seed)
            g = torch.Generator().manual_seed(a.seed)
            contexts = torch.randint(0, target.cfg.vocab_size, (max(cfg.Bs), cfg.L), generator=g)
        else:
            target, tok, folder = load_target(a.target, dtype=dtype, device=str(dev), progress=False)
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(dev).eval()
            data = prepare_data(tok, eos_id=document_separator_id(tok), progress=False)
            contexts = data.heldout_contexts(cfg.L, cfg.G, max(cfg.Bs), seed=cfg.seed)[:, : cfg.L]
        if a.vanilla_draft and not a.random_weights:
            from spire.drafts import make_draft

            from pathlib import Path

            vanilla = make_draft("vanilla", target, tok, a.vanilla_draft).model
            folder = Path(a.vanilla_draft)  # an HF folder, or a `spire train` run folder holding draft/
            folder = folder / "draft" if (folder / "draft" / "config.json").is_file() else folder
            hf_vanilla = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(dev).eval()
        else:
            print("vanilla rows skipped: no --vanilla-draft PATH given", file=sys.stderr)
        modes = ["float32", "bf16"] if a.weights == "both" else [a.weights]
        rows = []
        for mode in modes:
            if mode == "bf16":  # the same rounded weights for spire and HF: outputs stay comparable token by token
                from spire.fastpath import use_bf16_weights

                use_bf16_weights(target, hf, vanilla, hf_vanilla)
            for r in compare(target, hf, contexts, cfg, vanilla, hf_vanilla,
                             log=lambda m: print(m, file=sys.stderr, flush=True)):
                r["weights"] = mode
                if mode == "bf16":
                    r["method"] += " (bf16 weights)"
                rows.append(r)
        if len(modes) == 2:  # spire's bf16-weight rows against HF's own float32 model: the user's real choice
            for r in rows:
                hf32 = next(x for x in rows if x["B"] == r["B"] and x["weights"] == "float32"
                            and x["method"] == "HF generate (AD)")
                r["ratio_vs_hf_float32"] = r["tokens_per_s"] / hf32["tokens_per_s"]
                if r.get("decode_tokens_per_s") and hf32.get("decode_tokens_per_s"):
                    r["decode_ratio_vs_hf_float32"] = r["decode_tokens_per_s"] / hf32["decode_tokens_per_s"]
    except SpireError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_rows(rows, f"{a.target} {a.dtype}" + ("" if a.weights == "float32" else f", weights {a.weights}")
               + f" on {dev}, {torch.get_num_threads()} threads, {a.clock} clock: "
                     f"L={cfg.L}, G={cfg.G}, k={cfg.k}")
    for r in rows:
        if r.get("weights") == "bf16" and "ratio_vs_hf_float32" in r and r["method"].startswith("spire"):
            print(f"B={r['B']} {r['method']}: {r['ratio_vs_hf_float32']:.2f}x HF generate's float32 tokens/s "
                  f"(decode {r.get('decode_ratio_vs_hf_float32') or float('nan'):.2f}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": vars(a), "threads": torch.get_num_threads(), "device": str(dev), "rows": rows}, f,
                      indent=1)
        write_provenance(a.json)
    bad = [r for r in rows if not r["identical"]]
    if bad and a.dtype == "float32":
        print(f"outputs differ from HF generate: {[(r['B'], r['method']) for r in bad]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
