"""Teacher-forced alpha of SPIRe drafts on natural text vs the target's own continuations (T=0, T=1)."""
import sys, json, torch
from spire.data import document_separator_id, prepare_data
from spire.drafts.spire import SpireDraftModel
from spire.loading import load_target
from spire.sampling import SamplingParams
from spire.speculative import generate
from spire.training.distill import TrainConfig, fast_bf16, run_target, autocast, acceptance_alpha_logp
L, G, N, k = 512, 128, 16, 4
target, tokenizer, _ = load_target(progress=False)
data = prepare_data(tokenizer, eos_id=document_separator_id(tokenizer), progress=False)
nat = data.heldout_contexts(L, G, N, seed=1)
texts = {"natural": nat}
g = torch.Generator().manual_seed(1234)
for temp in (0.0, 1.0):
    r = generate(target, nat[:, :L], G, params=SamplingParams(temperature=temp), seed=1234)
    x = nat.clone(); x[:, L:] = torch.tensor([t[:G] for t in r.tokens]); texts[f"T{int(temp)}"] = x
torch.save(texts, "texts.pt")
torch.set_grad_enabled(False)
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
            # also argmax agreement
        a = torch.cat(A)[:, L:L+G]
        res[name] = [round(float(v), 3) for v in a.reshape(N, -1, k).mean((0, 1))]
    print(path, json.dumps(res), flush=True)
