"""On-policy training windows (an experiment, not a spire feature): replace the last G tokens of each of the
first STEPS training batches (4 x 256, seed 0: the batches `spire train` draws) by the target's own continuation
of the window's first 256 - G natural tokens; rows alternate greedy (T = 0) and sampled (T = 1).

    python gen.py STEPS G [CHUNK] [OUT]      # e.g. python gen.py 300 64 100 onpolicy_300_64.pt
"""
import os
import sys
import time

import torch

from spire.commands.train import load_data
from spire.loading import load_target
from spire.sampling import SamplingParams
from spire.speculative import generate
from spire.training.sources import step_generator

steps, G = int(sys.argv[1]), int(sys.argv[2])
chunk = int(sys.argv[3]) if len(sys.argv) > 3 else 64
out = sys.argv[4] if len(sys.argv) > 4 else f"onpolicy_{steps}_{G}.pt"
B, T, seed = 4, 256, 0
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 2)))
target, tok, _ = load_target(progress=False)
data = load_data(["registry"], tok, progress=False)
nat = torch.cat([data.sample_train_batch(B, T, step_generator(seed, s)) for s in range(steps)])
gen = nat.clone()
t0 = time.time()
g = torch.Generator().manual_seed(1234)
for temp in (0.0, 1.0):
    idx = torch.arange(int(temp), len(nat), 2)
    for i in range(0, len(idx), chunk):
        rows = idx[i:i + chunk]
        r = generate(target, nat[rows, :T - G], G, params=SamplingParams(temperature=temp), generator=g)
        new = torch.tensor([x[:G] for x in r.tokens])
        assert new.shape == (len(rows), G), new.shape  # no EOS ids passed: every row gets G tokens
        gen[rows, T - G:] = new
        print(f"T={temp} rows {i + len(rows)}/{len(idx)} {time.time() - t0:.0f}s", flush=True)
torch.save({"natural": nat, "generated": gen, "steps": steps, "G": G}, out)
print("saved", out, "changed fraction", (gen != nat).float().mean().item())
