"""What the bridge buys an untrained SPIRe draft: held-out α by drafted position of the pruned draft at
initialization, without the bridge and with it fitted to the target (SpireConfig.bridge,
:meth:`SpireDraftModel.start_training`, the trainer's fit on 32 training windows), on the same held-out windows that
`spire train` evaluates on. Prints one JSON object (also written to --out when given).

    python benchmarks/bridge_init.py --layers 0,1,24,25,26,27,28,29 --vocab-size 16384
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from spire.commands.train import heldout_windows
from spire.data import document_separator_id, prepare_data
from spire.drafts.spire import SpireConfig, SpireDraftModel
from spire.loading import load_target
from spire.paths import atomic_write
from spire.training.distill import TrainConfig, evaluate_heldout

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/_provenance.py, under an older spire too
from _provenance import write_provenance  # benchmarks/_provenance.py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--layers", default="0,1,24,25,26,27,28,29", help="the draft's target layers")
    ap.add_argument("--vocab-size", type=int, default=16384)
    ap.add_argument("--windows", type=int, default=16, help="held-out windows of 256 tokens")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    target, tok, _ = load_target(args.target, device=torch.device("cpu"), progress=False)
    data = prepare_data(tok, eos_id=document_separator_id(tok), progress=False)
    windows = heldout_windows(data, 256, args.windows)
    layers = tuple(int(j) for j in args.layers.split(","))
    result = {"target": args.target, "layers": list(layers), "vocab_size": args.vocab_size,
              "heldout_windows": args.windows, "k": args.k}
    for bridge in (False, True):
        cfg = TrainConfig(k=args.k, draft_config=SpireConfig(layers=layers, vocab_size=args.vocab_size, bridge=bridge))
        model = SpireDraftModel.for_training(target, cfg, data)
        model.start_training(data, cfg)  # the trainer's fit (nothing without a bridge)
        model.eval()
        alpha = evaluate_heldout(model, target, windows, TrainConfig(k=args.k, bf16=False))["alpha_per_position"]
        result["bridge" if bridge else "no_bridge"] = {"alpha_per_position": [round(a, 4) for a in alpha]}
        if bridge:
            result["bridge"].update(layer=model.bridge_layer, r2_in_sample=round(model.bridge_r2, 4))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        atomic_write(args.out, None, text + "\n")
        write_provenance(args.out)


if __name__ == "__main__":
    main()
