"""Interleaved A/B at (B, L) = (1, 512), one process, thread CPU clock: AD step (1 row) and verify (5 rows) of
SmolLM2-135M with the AVX2 path (spire.kernels.set_avx512(False)) vs the AVX-512 few-row path."""
import sys, time, statistics, torch
from spire import kernels
from spire.loading import load_target
from spire.model import use_bf16_weights
torch.set_num_threads(1)
w = sys.argv[1] if len(sys.argv) > 1 else "fp32"
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 7
m = load_target()[0]
if w == "bf16":
    use_bf16_weights(m)
L, k = 512, 4
cache = m.new_cache(1, L + 16)
ids = torch.randint(0, m.cfg.vocab_size, (1, L - 1))
with torch.no_grad():
    m(ids, torch.arange(L - 1)[None], cache)
    pend = ids[:, -1:]
    pos0 = torch.full((1, 1), L - 1)
    vtok = pend.expand(1, k + 1).contiguous(); vpos = pos0 + torch.arange(k + 1)
    res = {}
    for rep in range(reps):
        for a in (0, 1):
            kernels.set_avx512(bool(a))
            for name, fn in (("ad", lambda: m(pend, pos0, cache).logits), ("verify", lambda: m(vtok, vpos, cache).logits)):
                t = time.thread_time(); fn(); res.setdefault((name, a), []).append(time.thread_time() - t)
med = {kk: statistics.median(v) * 1e3 for kk, v in res.items()}
for a in (0, 1):
    print(f"{w} {'avx512' if a else 'avx2  '}: t_AD {med[('ad', a)]:.1f} ms  t_verify {med[('verify', a)]:.1f} ms  "
          f"ratio {med[('verify', a)] / med[('ad', a)]:.2f}  (median of {reps}, thread CPU time)")
