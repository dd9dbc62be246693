"""Host syncs counted on CPU tensors (issue 53, item 2): one target forward, each draft's step and observe of a
verify, the acceptance, and one training step's loss and backward make none when the positions go down as host
values (:class:`spire.kv_cache.Span`). The counter is :mod:`tests.syncs` (a torch function mode and a dispatch
mode); the first test holds it to known counts, so a zero below means nothing was read back."""

from __future__ import annotations

import pytest
import torch

from spire.backend import Backend, use
from spire.drafts.eagle3 import Eagle3Config, Eagle3Draft, Eagle3DraftModel
from spire.drafts.magicdec import MagicDecDraft
from spire.drafts.ngram import NgramDraft
from spire.drafts.spire import SpireConfig, SpireDraft, SpireDraftModel
from spire.drafts.vanilla import VanillaConfig, VanillaDraft, build_vanilla
from spire.kv_cache import SinkWindow, Span
from spire.params import SamplingParams
from spire.sampling import probs_from_logits, sample
from spire.training.distill import TrainConfig, _build_model, step_loss
from spire.training.sources import run_target
from spire.verification import output_tokens, verify, verify_greedy
from tests.conftest import make_tiny
from tests.syncs import count_syncs

B, K, L, MAX_LEN = 2, 3, 12, 64
STARTS = (L, L + 3)  # each row's pending position


@pytest.fixture(scope="module")
def target():
    return make_tiny()


def test_the_counter_counts_each_kind_of_sync():
    """.item(), bool(), int(), .tolist(), .cpu(), nonzero, a boolean index and masked_select: one each, where made."""
    x = torch.arange(6.0)
    with count_syncs() as s:
        x[0].item()
        bool(x.any())
        int(x[1])
        x.tolist()
        x.cpu()
        x.nonzero()
        x[x > 2]
        x.masked_select(x > 1)
        x.to(x.device)  # not a copy to the host (nor any of what follows): not counted
        x.argmax()
        torch.where(x > 2, x, 0)
    assert [what for what, _ in s.events] == ["_local_scalar_dense", "_local_scalar_dense", "_local_scalar_dense",
                                              "Tensor.tolist", "Tensor.cpu", "nonzero", "boolean index",
                                              "masked_select"], str(s)
    assert all(where.startswith("test_host_syncs.py:") for _, where in s.events)


def _forward(target, cache, T, span, view=None):
    pos = torch.tensor(STARTS)[:, None] + torch.arange(T)
    return target(torch.zeros(B, T, dtype=torch.long), pos, cache, view=view, span=span).logits


def test_target_forward_reads_nothing_back_with_a_span(target):
    """Prefill, decode step, verify over k + 1 positions and a windowed verify (MagicDec's view): no sync with the
    positions' span; without it the CPU plan reads the positions back (what the span saves)."""
    cache = target.new_cache(B, MAX_LEN)
    with count_syncs() as s:
        target(torch.zeros(B, L + 3, dtype=torch.long), torch.arange(L + 3)[None].expand(B, -1), cache,
               span=Span((0, 0), L + 3)).logits
        _forward(target, cache, 1, Span(STARTS, 1))
        _forward(target, cache, K + 1, Span(STARTS, K + 1))
        _forward(target, cache, K + 1, Span(STARTS, K + 1), SinkWindow(1, 4))
    assert len(s) == 0, str(s)
    with count_syncs() as s:
        _forward(target, cache, K + 1, None)
    assert len(s) > 0


def _drafts(target):
    g = torch.Generator().manual_seed(0)
    eagle = Eagle3DraftModel(target, Eagle3Config(draft_vocab=60, layers=(1, 2, 4)),
                             torch.randperm(97, generator=g)[:60].sort().values)
    return {"spire": SpireDraft(SpireDraftModel(target, SpireConfig(n_draft_layers=2, window=4)).requires_grad_(False)),
            "spire-features": SpireDraft(SpireDraftModel(target, SpireConfig(n_draft_layers=2, window=4,
                                                                             feature_input=True)).requires_grad_(False)),
            "spire-dense": SpireDraft(SpireDraftModel(target, SpireConfig(n_draft_layers=2, window=None))
                                      .requires_grad_(False)),
            "magicdec": MagicDecDraft(1, 4),
            "vanilla": VanillaDraft(build_vanilla(target, 1).eval().requires_grad_(False)),
            "eagle3": Eagle3Draft(eagle.eval().requires_grad_(False)),
            "ngram": NgramDraft()}


@pytest.mark.parametrize("kind", ["spire", "spire-features", "spire-dense", "magicdec", "vanilla", "eagle3", "ngram"])
def test_draft_round_reads_nothing_back_with_spans(target, kind):
    """k draft steps and the observe of the verify, each given its span: no host sync."""
    draft = _drafts(target)[kind]
    cache = target.new_cache(B, MAX_LEN)
    tokens = torch.randint(0, 97, (B, L), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(L)[None].expand(B, L)
    draft.start(target, cache, B, MAX_LEN, K)
    draft.observe(tokens, pos, target(tokens, pos, cache, hidden_layers=draft.hidden_layers))
    p0 = torch.tensor(STARTS)[:, None]
    tok = tokens[:, -1:]
    with count_syncs() as s:
        for j in range(K):
            tok = draft.step(tok, p0 + j, span=Span(STARTS, 1).shifted(j)).argmax(-1, keepdim=True)
        vpos = p0 + torch.arange(K + 1)
        out = target(torch.zeros(B, K + 1, dtype=torch.long), vpos, cache, hidden_layers=draft.hidden_layers,
                     span=Span(STARTS, K + 1))
        draft.observe(torch.zeros(B, K + 1, dtype=torch.long), vpos, out, span=Span(STARTS, K + 1))
    assert len(s) == 0, str(s)


def test_acceptance_reads_nothing_back():
    """Greedy and rejection-sampling verification up to the accepted counts and the next token, the output block,
    the sampling transform and the draw: no host sync (the engine reads the counts back once, after)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, K + 1, 97, generator=g)
    d_tokens = torch.randint(0, 97, (B, K), generator=g)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05)
    with count_syncs() as s:
        n, x = verify_greedy(d_tokens, logits)
        output_tokens(d_tokens, n, x)
        q = probs_from_logits(torch.randn(B, K, 97, generator=g), params)
        d = sample(q, g)
        n, x = verify(d, q, probs_from_logits(logits, params), g)
        output_tokens(d, n, x)
    assert len(s) == 0, str(s)


@pytest.mark.parametrize("kind", ["spire", "eagle3", "vanilla"])
def test_training_loss_and_backward_read_nothing_back(target, kind):
    """One training step's loss (MixedLoss, KL, HardTargetLoss with its alpha) and backward: no host sync (the
    trainer reads the logged values once per step, :meth:`spire.training.distill.Trainer._update`). The native loss
    kernels run on the CPU only and read their inputs there: off here, as off the CPU."""
    dc = {"spire": SpireConfig(n_draft_layers=2, window=4), "eagle3": Eagle3Config(draft_vocab=0, layers=(1, 2, 4)),
          "vanilla": VanillaConfig(n_layers=1)}[kind]
    cfg = TrainConfig(draft=kind, draft_config=dc, k=3, bf16=False, seq_len=12, batch_size=2)
    model = use(_build_model(target, cfg, None), Backend(loss_kernel=False))
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(2))
    tb = run_target(target, tokens, model.target_layers(), True)
    with count_syncs() as s:
        loss, alpha = step_loss(model, target, tb, cfg)
        loss.backward()
    assert len(s) == 0, str(s)
    assert loss.requires_grad and 0 < float(alpha) <= 1


@pytest.mark.parametrize("kind", ["none", "spire", "spire-features", "magicdec", "vanilla", "eagle3", "ngram"])
def test_an_engine_step_reads_the_device_once(target, kind):
    """One steady Engine.step (two greedy rows decoding, AD or k = 3) passes its positions down as spans from the
    runner's host copy of the committed lengths, so it reads the device once: the accepted counts and the output
    block, in one copy (the n-gram draft looks up on the host's token ids, :func:`~spire.drafts.ngram.host_source`). The host copy equals
    the device's lengths after every step."""
    from spire.engine.engine import Engine
    from spire.engine.scheduler import RoundChoice
    from spire.params import RequestParams

    drafts = None if kind == "none" else [_drafts(target)[kind]]
    engine = Engine(target, drafts, k=K, max_running=2, max_len=MAX_LEN)
    for i, prompt in enumerate(([5, 6, 7, 5, 6, 7, 5, 6], [9, 3, 1, 4, 1, 5])):
        engine.add_request(prompt, RequestParams(max_tokens=30, ignore_eos=True))

    class Every:  # AD and SD rounds in turn, so that both are counted
        def __init__(self):
            self.k = 0

        def choose(self, plan, width, proposes):
            self.k = 0 if self.k else K
            return RoundChoice(self.k, [0] * len(plan.running), [self.k] * len(plan.running))

        def update(self, plan, accepted, seconds):
            pass

    if drafts:
        engine.scheduler.k_policy = Every()
    runner = engine.runner
    for _ in range(3):
        engine.step()
        assert runner.n_host == runner.n.tolist()
    for _ in range(2):  # one AD round and one SD round (with a draft)
        with count_syncs() as s:
            engine.step()
        assert runner.n_host == runner.n.tolist()
        assert len(s) == 1, str(s)
