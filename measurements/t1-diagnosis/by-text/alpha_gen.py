"""Teacher-forced alpha of SPIRe drafts on natural text vs the target's own continuations (T=0, T=1)."""
import sys, json, torch
from common import per_position, teacher_forced_alpha  # this folder
from spire.data import document_separator_id, prepare_data
from spire.loading import load_target
from spire.sampling import SamplingParams
from spire.speculative import generate
L, G, N, k = 512, 128, 16, 4
target, tokenizer, _ = load_target(progress=False)
data = prepare_data(tokenizer, eos_id=document_separator_id(tokenizer), progress=False)
nat = data.heldout_contexts(L, G, N, seed=1)
texts = {"natural": nat}
for temp in (0.0, 1.0):
    r = generate(target, nat[:, :L], G, params=SamplingParams(temperature=temp), seed=1234)
    x = nat.clone(); x[:, L:] = torch.tensor([t[:G] for t in r.tokens]); texts[f"T{int(temp)}"] = x
torch.save(texts, "texts.pt")
for path in sys.argv[1:]:
    res = {name: per_position(teacher_forced_alpha(path, target, w)[:, L:L + G]) for name, w in texts.items()}
    print(path, json.dumps(res), flush=True)
