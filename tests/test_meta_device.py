"""Every computation that runs on the device, run on the ``meta`` device (issue 53, item 1).

A computation on meta tensors refuses a CPU operand ("Tensor on device cpu is not on the expected device meta!") and
a host sync ("Tensor.item() cannot be called on meta tensors"), and spire's CPU-only paths (native kernels, oneDNN,
kept weight copies) are gated on ``device.type == "cpu"``. So a forward that runs here creates nothing on the CPU and
reads nothing back: what a CUDA run needs, checked on a CPU-only build. Positions go down as host values
(:class:`spire.kv_cache.Span`); without one the forward plans without them (the whole cache under the mask), and both
are run. Shapes, dtypes and devices of the results are asserted (meta tensors hold no values); the values are the
CPU tests' business.
"""

from __future__ import annotations

import types

import pytest
import torch

from spire import fastpath, kernels
from spire.drafts.eagle3 import Eagle3Config, Eagle3Draft, Eagle3DraftModel
from spire.drafts.magicdec import MagicDecDraft
from spire.drafts.ngram import NgramDraft
from spire.drafts.spire import SpireConfig, SpireDraft, SpireDraftModel
from spire.drafts.vanilla import VanillaDraft, build_vanilla
from spire.kv_cache import Span
from spire.model import Transformer
from spire.params import LogitsProcessing, SamplingParams
from spire.sampling import TokenHistory, logprobs_from_logits, probs_from_logits, process_logits, sample
from spire.verification import output_tokens, verify, verify_greedy
from tests.conftest import tiny_config

META = torch.device("meta")
DTYPES = [torch.float32, torch.bfloat16]
B, K, L, MAX_LEN = 3, 3, 5, 48  # rows, draft tokens per round, prompt length, cache positions
# L <= k + 2: a SPIRe draft's observe of more positions than its ring (or its k + 2 kept features) holds selects
# the entries to keep (a prefill's host sync, not a round's), so the prefill here stays within them
V = 97


@pytest.fixture(autouse=True)
def cpu_only_paths_refused(monkeypatch):
    """spire's native kernels (every one loads the library through ``kernels.load``) and oneDNN raise when reached:
    none may be, off the CPU."""
    def refuse(*_, **__):
        raise AssertionError("a CPU-only path (native kernels, oneDNN) was reached off the CPU")

    monkeypatch.setattr(kernels, "load", refuse)
    monkeypatch.setattr(fastpath.matmul, "onednn", refuse)  # where fastpath.linear calls it


def on_meta(x: torch.Tensor, *shape: int, dtype: torch.dtype | None = None) -> None:
    assert x.device == META, f"a result on {x.device}"
    assert tuple(x.shape) == shape, f"shape {tuple(x.shape)}, expected {shape}"
    if dtype is not None:
        assert x.dtype == dtype


@pytest.fixture(scope="module", params=DTYPES, ids=["float32", "bf16"])
def target(request) -> Transformer:
    with torch.device(META):
        model = Transformer(tiny_config(max_positions=MAX_LEN))
    return model.to(request.param).eval().requires_grad_(False)


def prefilled(target: Transformer, hidden_layers=()):
    """A target cache on meta after a prefill of L positions per row (span given), and the prefill's output."""
    cache = target.new_cache(B, MAX_LEN)
    tokens = torch.zeros(B, L, dtype=torch.long, device=META)
    pos = torch.arange(L, device=META)[None].expand(B, L)
    out = target(tokens, pos, cache, hidden_layers=hidden_layers, span=Span((0,) * B, L))
    return cache, tokens, pos, out


ROUND_STARTS = (L, L + 2, L + 5)  # each row's pending position: rows at different lengths


@pytest.mark.parametrize("with_span", [True, False], ids=["span", "no-span"])
def test_target_prefill_decode_verify_on_meta(target, with_span):
    """Prefill, a decode step and a verify forward over k + 1 positions run on meta, logits and kept hidden states on
    meta in the right shapes, and the cache stays on meta; with the positions' span and without one."""
    cache, _, _, out = prefilled(target, hidden_layers=(1, 4))
    on_meta(out.logits, B, L, V, dtype=torch.float32)
    on_meta(out.hidden[4], B, L, target.cfg.d_model, dtype=target.dtype)
    starts = torch.tensor(ROUND_STARTS, device=META)  # device positions, as the engine keeps them
    span = Span(ROUND_STARTS, 1) if with_span else None
    step = target(torch.zeros(B, 1, dtype=torch.long, device=META), starts[:, None], cache, span=span)
    on_meta(step.logits, B, 1, V)
    vpos = starts[:, None] + torch.arange(K + 1, device=META)
    span = Span(ROUND_STARTS, K + 1) if with_span else None
    ver = target(torch.zeros(B, K + 1, dtype=torch.long, device=META), vpos, cache, hidden_layers=(2,), span=span)
    on_meta(ver.logits, B, K + 1, V)
    on_meta(ver.hidden[2], B, K + 1, target.cfg.d_model)
    assert all(t.device == META for t in cache.k + cache.v)
    # a sink + window view (MagicDec's read of the target cache) and the same positions in every row (slice writes)
    same = Span((L,) * B, K + 1) if with_span else None
    vpos = torch.full((B, 1), L, device=META) + torch.arange(K + 1, device=META)
    from spire.kv_cache import SinkWindow

    on_meta(target(torch.zeros(B, K + 1, dtype=torch.long, device=META), vpos, cache, view=SinkWindow(1, 4),
                   span=same).logits, B, K + 1, V)


def make_drafts(target: Transformer) -> dict:
    """One of every kind, built on meta (weights on meta, in the target's dtype)."""
    with torch.device(META):
        spire = SpireDraftModel(target, SpireConfig(n_draft_layers=2, window=4, feature_input=True))
        spire_full = SpireDraftModel(target, SpireConfig(n_draft_layers=2, window=None))
        eagle = Eagle3DraftModel(target, Eagle3Config(draft_vocab=0, layers=(1, 2, 4)))
        vanilla = build_vanilla(target, 1)
    drafts = {"spire": SpireDraft(spire.to(target.dtype).requires_grad_(False)),
              "spire-dense": SpireDraft(spire_full.to(target.dtype).requires_grad_(False)),
              "magicdec": MagicDecDraft(1, 4),
              "vanilla": VanillaDraft(vanilla.to(target.dtype).eval().requires_grad_(False)),
              "eagle3": Eagle3Draft(eagle.to(target.dtype).eval().requires_grad_(False)),
              "ngram": NgramDraft()}
    return drafts


@pytest.mark.parametrize("kind", ["spire", "spire-dense", "magicdec", "vanilla", "eagle3", "ngram"])
def test_draft_round_on_meta(target, kind):
    """Each draft's part of a round on meta: observe the prefill, k steps (SPIRe: its ring cache and memory; MagicDec:
    the windowed view of the target cache), then observe the verify, with host spans; logits (B, V) float32."""
    draft = make_drafts(target)[kind]
    cache, tokens, pos, out = prefilled(target, hidden_layers=draft.hidden_layers)
    draft.start(target, cache, B, MAX_LEN, K)
    draft.observe(tokens, pos, out, span=Span((0,) * B, L))
    p0 = torch.tensor(ROUND_STARTS, device=META)[:, None]
    tok = torch.zeros(B, 1, dtype=torch.long, device=META)
    for j in range(K):
        z = draft.step(tok, p0 + j, span=Span(ROUND_STARTS, 1).shifted(j))
        on_meta(z, B, V, dtype=torch.float32)
        tok = z.argmax(-1, keepdim=True)
    vpos = p0 + torch.arange(K + 1, device=META)
    span = Span(ROUND_STARTS, K + 1)
    ver = target(torch.zeros(B, K + 1, dtype=torch.long, device=META), vpos, cache,
                 hidden_layers=draft.hidden_layers, span=span)
    draft.observe(torch.zeros(B, K + 1, dtype=torch.long, device=META), vpos, ver, span=span)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_acceptance_and_sampling_on_meta(greedy):
    """The acceptance computation up to the accepted counts and the next token, the output block, and the sampling
    transforms (penalties, bias, min_tokens, temperature, min-p, top-k, top-p, logprobs, the draw) on meta."""
    logits = torch.zeros(B, K + 1, V, device=META)
    d_tokens = torch.zeros(B, K, dtype=torch.long, device=META)
    params = SamplingParams(temperature=0.0 if greedy else 0.8, top_k=0 if greedy else 20,
                            top_p=1.0 if greedy else 0.9, min_p=0.0 if greedy else 0.05)
    if greedy:
        n_acc, nxt = verify_greedy(d_tokens, logits)
    else:
        q = probs_from_logits(torch.zeros(B, K, V, device=META), params)
        p = probs_from_logits(logits, params)
        on_meta(p, B, K + 1, V, dtype=torch.float32)
        n_acc, nxt = verify(d_tokens, q, p)
    on_meta(n_acc, B, dtype=torch.int64)
    on_meta(nxt, B)
    on_meta(output_tokens(d_tokens, n_acc, nxt), B, K + 1)
    proc = LogitsProcessing(logit_bias=((3, 1.5),), min_tokens=2, banned=(0,), repetition_penalty=1.2,
                            presence_penalty=0.5, frequency_penalty=0.3)
    history = TokenHistory([1, 2, 3], V, META)
    history.add([4, 5])
    row = process_logits(logits[0], proc, history, 2, [7, 8, 9], 0)
    on_meta(row, K + 1, V, dtype=torch.float32)
    on_meta(logprobs_from_logits(row, params), K + 1, V)
    on_meta(sample(probs_from_logits(row, params)), K + 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bf16"])
@pytest.mark.parametrize("kind", ["spire", "eagle3", "vanilla"])
def test_training_loss_forward_and_backward_on_meta(kind, dtype):
    """One training step's loss (SPIRe's k-pass MixedLoss, EAGLE-3's KL, vanilla's HardTargetLoss with its alpha) and
    backward on meta, from a target cache's tensors (residual streams, final normed state, log Z; the compact cache
    holds them in bf16, and the bf16 case runs the weights in bf16 too: autocast has no meta device). The draft is
    built on the CPU as the trainer builds it (its draft vocabulary chosen there), then moved to meta."""
    from spire.drafts.eagle3 import Eagle3Config
    from spire.drafts.vanilla import VanillaConfig
    from spire.training.distill import TrainConfig, _build_model, step_loss
    from spire.training.sources import TeacherBatch
    from tests.conftest import make_tiny

    target = make_tiny()
    dc = {"spire": SpireConfig(n_draft_layers=2, window=4, vocab_size=60),
          "eagle3": Eagle3Config(draft_vocab=60, layers=(1, 2, 4)), "vanilla": VanillaConfig(n_layers=1)}[kind]
    cfg = TrainConfig(draft=kind, draft_config=dc, k=K, bf16=False, seq_len=4 * K, batch_size=2)
    data = types.SimpleNamespace(train=types.SimpleNamespace(tokens=torch.arange(400) % V))
    model = _build_model(target, cfg, data)
    target.to(META, dtype)
    model.to(META, dtype)
    Bt, T, d = 2, 4 * K, target.cfg.d_model
    x = lambda *shape: torch.zeros(*shape, device=META, dtype=dtype)  # noqa: E731
    tb = TeacherBatch(torch.zeros(Bt, T, dtype=torch.long, device=META), {j: x(Bt, T, d) for j in model.target_layers()},
                      x(Bt, T, d), torch.zeros(Bt, T, device=META))
    loss, alpha = step_loss(model, target, tb, cfg)
    loss.backward()
    assert loss.device == alpha.device == META and loss.shape == alpha.shape == ()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.device == META for g in grads)
