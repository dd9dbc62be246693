"""Greedy speculative decoding is token-for-token identical to greedy AD, in float32 (issue 2; CASES.md 3, 5)."""

import pytest
import torch

from spire.drafts.magicdec import MagicDecDraft
from spire.drafts.spire import SpireConfig, SpireDraft, SpireDraftModel
from spire.errors import ConfigError
from spire.sampling import SamplingParams
from spire.speculative import generate
from tests.helpers import NoisyTargetDraft


def _prompts(n_vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, n_vocab, (n,), generator=g).tolist() for n in lengths]


def _drafts(target):
    return [MagicDecDraft(sink=1, window=4), NoisyTargetDraft(noise=1.0),
            SpireDraft(SpireDraftModel(target, SpireConfig(n_draft_layers=2, window=8)))]


@pytest.mark.parametrize("lengths", [[1], [300], [1, 17, 300], [5, 5]])
def test_greedy_identity_tiny(tiny, lengths):
    prompts = _prompts(97, lengths)
    ad = generate(tiny, prompts, 64)
    assert all(len(t) == 64 for t in ad.tokens)
    for b, p in enumerate(prompts):  # each row equals its own batch-1 AD output
        assert generate(tiny, [p], 64).tokens[0] == ad.tokens[b]
    for draft in _drafts(tiny):
        sd = generate(tiny, prompts, 64, draft=draft, k=4)
        assert sd.tokens == ad.tokens, draft.name
        assert sd.emitted == [64] * len(prompts)  # budget never overshot
        assert sd.tau == pytest.approx(sum(sd.emitted) / sum(sd.rounds))


def test_every_branch_is_exercised(tiny):
    """The noisy draft must reject at 0, mid-block and accept all within the run (else the identity test
    above would not cover those branches)."""
    sd = generate(tiny, _prompts(97, [1, 17, 300]), 64, draft=NoisyTargetDraft(noise=0.6), k=4)
    seen = {a for rnd in sd.accepted_per_round for a in rnd}
    assert {0, 4} <= seen and seen & {1, 2, 3}


def test_batch_permutation_and_duplicates(tiny):
    prompts = _prompts(97, [3, 40, 11])
    draft = NoisyTargetDraft(noise=0.8)
    out = generate(tiny, prompts, 32, draft=draft).tokens
    perm = generate(tiny, [prompts[2], prompts[0], prompts[1]], 32, draft=NoisyTargetDraft(noise=0.8)).tokens
    assert perm == [out[2], out[0], out[1]]
    dup = generate(tiny, [prompts[1], prompts[1]], 32, draft=MagicDecDraft(1, 4)).tokens
    assert dup[0] == dup[1] == out[1]


def test_magicdec_with_full_window_is_the_target(tiny):
    """A window covering the whole context makes MagicDec the target itself: greedy τ is exactly k + 1."""
    res = generate(tiny, _prompts(97, [50, 60]), 40, draft=MagicDecDraft(sink=1, window=1000), k=4)
    assert res.tau == 5.0 and res.rounds == [8, 8]


def test_eos_stops_a_row_exactly(tiny):
    prompts = _prompts(97, [7, 9])
    ad = generate(tiny, prompts, 40).tokens
    eos = ad[0][10]
    first = ad[0].index(eos)
    sd = generate(tiny, prompts, 40, draft=NoisyTargetDraft(0.5), eos_ids=[eos])
    assert sd.tokens[0] == ad[0][: first + 1] and sd.finish_reasons[0] == "stop"
    if eos in ad[1]:
        assert sd.tokens[1] == ad[1][: ad[1].index(eos) + 1]
    else:
        assert sd.tokens[1] == ad[1] and sd.finish_reasons[1] == "length"


def test_bad_generation_settings(tiny):
    with pytest.raises(ConfigError, match="k must be"):
        generate(tiny, [[1, 2]], 4, draft=MagicDecDraft(), k=0)
    with pytest.raises(ConfigError, match="empty prompt"):
        generate(tiny, [[]], 4)
    with pytest.raises(ConfigError, match="exceeds the target"):
        generate(tiny, [[1] * 1000], 100)


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_identity_smollm2(smollm2, batch):
    """Real target, float32: MagicDec and SPIRe greedy outputs equal greedy AD for batch 1 and 3."""
    model, tok = smollm2
    text = ("Now is the winter of our discontent made glorious summer by this sun of York; and all the "
            "clouds that lour'd upon our house in the deep bosom of the ocean buried. ") * 8
    ids = tok(text).input_ids
    prompts = [ids[:120], ids[:1], ids[:37]][:batch]
    ad = generate(model, prompts, 24).tokens
    for draft in (MagicDecDraft(sink=1, window=16),
                  SpireDraft(SpireDraftModel(model, SpireConfig(n_draft_layers=2, window=16)))):
        assert generate(model, prompts, 24, draft=draft, k=4).tokens == ad, draft.name


def test_temperature_sampling_is_reproducible(tiny):
    prompts = _prompts(97, [5, 8])
    runs = [generate(tiny, prompts, 20, draft=MagicDecDraft(1, 4), params=SamplingParams(1.0, top_p=0.9),
                     generator=torch.Generator().manual_seed(7)).tokens for _ in range(2)]
    assert runs[0] == runs[1]
