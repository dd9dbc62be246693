"""Held-out α per drafted position of SPIRe draft files, on the trainer's 16 held-out windows of 256 tokens (what
`spire train` evaluates), under bf16 autocast as the trainer evaluates where bf16 is fast.

    python measurements/reproduce-cpu-amx/heldout_alpha.py $SPIRE_CACHE/drafts/<run>/draft.safetensors [...]

Written for the main job's draft of this folder, whose in-training evaluations measured stale weight copies (the
fused AdamW kernel did not bump version counters; fixed in spire.training.distill.make_optimizer)."""
import sys

import torch

from spire.commands.train import heldout_windows
from spire.data import document_separator_id, prepare_data
from spire.drafts.spire import SpireDraftModel
from spire.loading import load_target
from spire.training.distill import TrainConfig, evaluate_heldout, fast_bf16

target, tokenizer, _ = load_target(progress=False)
data = prepare_data(tokenizer, eos_id=document_separator_id(tokenizer), progress=False)
windows = heldout_windows(data, 256, 16)
for path in sys.argv[1:]:
    model = SpireDraftModel.load(path, target)
    cfg = TrainConfig(k=4, bf16=fast_bf16(torch.device("cpu")))
    alpha = evaluate_heldout(model, target, windows, cfg)["alpha_per_position"]
    print(path, " ".join(f"{a:.3f}" for a in alpha))
