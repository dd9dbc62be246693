"""Teacher-forced alpha (1-TV) of SPIRe draft files by absolute position bin, on held-out windows of T tokens."""
import sys, json
import torch
from common import per_position, teacher_forced_alpha  # this folder
from spire.data import document_separator_id, prepare_data
from spire.loading import load_target

T = int(sys.argv[1]); N = int(sys.argv[2]); k = 4
target, tokenizer, _ = load_target(progress=False)
data = prepare_data(tokenizer, eos_id=document_separator_id(tokenizer), progress=False)
windows = data.heldout_contexts(T - 64, 64, N, seed=1)
for path in sys.argv[3:]:
    a = teacher_forced_alpha(path, target, windows, rows=2)  # (N, T)
    bins = {f"{s}-{s + 256}": per_position(a[:, s:s + 256]) for s in range(0, T, 256)}
    print(path, json.dumps(bins), flush=True)
