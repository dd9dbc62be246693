"""alpha of drafts on natural text where a fraction r of tokens is replaced by a one-step target sample."""
import sys, json, torch
from spire.drafts.spire import SpireDraftModel
from spire.loading import load_target
from spire.training.distill import TrainConfig, fast_bf16, autocast, acceptance_alpha_logp
from spire.training.sources import run_target
L, G, N, k = 512, 128, 16, 4
target, tokenizer, _ = load_target(progress=False)
texts = torch.load("texts.pt")
nat = texts["natural"]
torch.set_grad_enabled(False)
gen = torch.Generator().manual_seed(7)
ys = []
for i in range(0, N, 4):
    tb = run_target(target, nat[i:i+4], (), True, False)
    p = torch.softmax(tb.logits.float(), -1)
    ys.append(torch.multinomial(p.view(-1, p.shape[-1]), 1, generator=gen).view(p.shape[:2]))
y = torch.cat(ys)  # y[:, t] sample of token t+1
for r in (0.15, 0.5, 1.0):
    m = torch.rand(nat.shape, generator=gen) < r; m[:, 0] = False
    x = nat.clone(); x[:, 1:] = torch.where(m[:, 1:], y[:, :-1], nat[:, 1:])
    texts[f"sub{r}"] = x
for path in sys.argv[1:]:
    model = SpireDraftModel.load(path, target); model.eval()
    cfg = TrainConfig(k=k, bf16=fast_bf16(torch.device("cpu")))
    res = {}
    for name, w in texts.items():
        A = []
        for i in range(0, N, 4):
            tokens = w[i:i+4]
            tb = run_target(target, tokens, model.target_layers(), True, bool(cfg.bf16))
            with autocast(bool(cfg.bf16), target.device):
                q = model.train_logits(tokens, tb.hidden, k)
                logp = tb.target_logp(target, model.vocab)
            A.append(acceptance_alpha_logp(q, logp).float().cpu())
        a = torch.cat(A)[:, L:L+G]
        res[name] = [round(float(v), 3) for v in a.reshape(N, -1, k).mean((0, 1))]
    print(path, json.dumps(res), flush=True)
