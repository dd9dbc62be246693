"""alpha of drafts on natural text where a fraction r of tokens is replaced by a one-step target sample."""
import sys, json, torch
from common import per_position, teacher_forced_alpha  # this folder
from spire.loading import load_target
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
    res = {name: per_position(teacher_forced_alpha(path, target, w)[:, L:L + G]) for name, w in texts.items()}
    print(path, json.dumps(res), flush=True)
