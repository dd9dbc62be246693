"""What differs on the target's T = 1 text: target entropy, the target's mass inside the draft vocabulary, α at equal
target entropy, and α under draft-side transforms (temperature, top-p). Needs texts.pt from alpha_gen.py."""
import sys, json, torch, torch.nn.functional as F
from spire.data import document_separator_id, prepare_data
from spire.drafts.spire import SpireDraftModel
from spire.drafts.vocab import frequent_tokens, probable_tokens
from spire.loading import load_target
from spire.training.distill import TrainConfig, autocast, fast_bf16, run_target
L, G, k = 512, 128, 4
target, tokenizer, _ = load_target(progress=False)
texts = torch.load("texts.pt")
bf16 = bool(TrainConfig(k=k, bf16=fast_bf16(torch.device("cpu"))).bf16)


def top_p(q, pp):
    s, i = q.sort(-1, descending=True)
    s = s * ((s.cumsum(-1) - s) < pp)
    out = torch.zeros_like(q).scatter(-1, i, s)
    return out / out.sum(-1, keepdim=True)


@torch.no_grad()
def vocabularies():
    """The target's mass on each text inside the 16,384 most frequent training tokens and inside the 16,384 of
    largest target mass over 64 training windows (:func:`probable_tokens`, as `vocab_from="mass"` chooses)."""
    data = prepare_data(tokenizer, eos_id=document_separator_id(tokenizer), progress=False)
    V = target.cfg.vocab_size
    vocab = {"frequency": frequent_tokens(data.train.tokens, 16384, V),
             "mass": probable_tokens(target, data.sample_train_batch(64, 256, torch.Generator().manual_seed(0)),
                                     16384, bf16=bf16)}
    out = {}
    for name, w in texts.items():
        pos = torch.arange(w.shape[1]).expand(w.shape[0], -1)
        p = F.softmax(target(w, pos).logits.float()[:, L:L + G], -1)
        out[name] = {v: round(float(p[..., ids].sum(-1).mean()), 4) for v, ids in vocab.items()}
    print("inside-vocabulary mass", json.dumps(out), flush=True)


@torch.no_grad()
def draft_on_texts(path):
    model = SpireDraftModel.load(path, target).eval()
    res = {}
    for name, w in texts.items():
        cols = {}
        for i in range(0, w.shape[0], 4):
            tokens = w[i:i + 4]
            tb = run_target(target, tokens, model.target_layers(), True, bf16)
            with autocast(bf16, target.device):
                z = model.train_logits(tokens, tb.hidden, k)
                logp = tb.target_logp(target, model.vocab)
            z, p = z.float()[:, L:L + G], logp.float()[:, L:L + G].exp()  # p over the draft's vocabulary
            q = F.softmax(z, -1)
            variants = {"q": q, **{f"T{c}": F.softmax(z / c, -1) for c in (0.9, 1.1)},
                        **{f"top_p{pp}": top_p(q, pp) for pp in (0.9, 0.98)}}
            for key, v in variants.items():
                cols.setdefault(key, []).append(torch.minimum(p, v).sum(-1).flatten())
            cols.setdefault("H", []).append(_entropy(tb))
        c = {key: torch.cat(v) for key, v in cols.items()}
        H, a = c.pop("H"), c["q"]
        bins = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 99)]
        res[name] = {"H(p)": round(float(H.mean()), 3),
                     "alpha": {key: round(float(v.mean()), 4) for key, v in c.items()},
                     "alpha by H(p)": {f"{lo}-{hi}": [round(float(a[(H >= lo) & (H < hi)].mean()), 3),
                                                      int(((H >= lo) & (H < hi)).sum())] for lo, hi in bins}}
    print(path, json.dumps(res), flush=True)


def _entropy(tb):
    """H(p) in nats of the target's whole-vocabulary distribution at the positions after the context."""
    lp = tb.target_logp(target, None).float()[:, L:L + G]
    return -(lp.exp() * lp).sum(-1).flatten()


vocabularies()
for path in sys.argv[1:]:
    draft_on_texts(path)
