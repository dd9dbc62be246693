"""Teacher-forced alpha (1-TV) of SPIRe draft files by absolute position bin, on held-out windows of T tokens."""
import sys, json
import torch
from spire.data import document_separator_id, prepare_data
from spire.drafts.spire import SpireDraftModel
from spire.loading import load_target
from spire.training.distill import TrainConfig, fast_bf16, run_target, autocast, acceptance_alpha_logp

T = int(sys.argv[1]); N = int(sys.argv[2]); k = 4
target, tokenizer, _ = load_target(progress=False)
data = prepare_data(tokenizer, eos_id=document_separator_id(tokenizer), progress=False)
windows = data.heldout_contexts(T - 64, 64, N, seed=1)
torch.set_grad_enabled(False)
for path in sys.argv[3:]:
    model = SpireDraftModel.load(path, target); model.eval()
    cfg = TrainConfig(k=k, bf16=fast_bf16(torch.device("cpu")))
    A = []
    for i in range(0, N, 2):
        tokens = windows[i:i+2]
        tb = run_target(target, tokens, model.target_layers(), True, bool(cfg.bf16))
        with autocast(bool(cfg.bf16), target.device):
            q = model.train_logits(tokens, tb.hidden, k)
            logp = tb.target_logp(target, model.vocab)
        A.append(acceptance_alpha_logp(q, logp).float().cpu())
    a = torch.cat(A)  # (N, T)
    bins = {}
    for s in range(0, T, 256):
        blk = a[:, s:s+256].reshape(N, -1, k).mean((0, 1))
        bins[f"{s}-{s+256}"] = [round(float(x), 3) for x in blk]
    print(path, json.dumps(bins), flush=True)
