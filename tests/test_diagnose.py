"""spire tau --diagnose (spire.evaluation.diagnose): the diagnosis reads the same rounds as τ and measures what it
says it measures."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from spire.drafts.spire import SpireConfig, SpireDraft, SpireDraftModel
from spire.evaluation.diagnose import Diagnosis, diagnose_shared, tau_from_alpha, verified_tv
from spire.evaluation.tau import measure_tau_shared
from spire.sampling import SamplingParams
from tests.test_engine import _draft

KINDS = ["magicdec", "spire", "spire-vocab", "eagle3-full-vocab"]


def _make(kind, target):
    if kind == "spire-vocab":  # a draft vocabulary of 60 of the 97 tokens: q = 0 elsewhere
        torch.manual_seed(3)
        return SpireDraft(SpireDraftModel(target, SpireConfig(n_draft_layers=2, window=4, vocab_size=60),
                                          vocab=torch.arange(20, 80)))
    return _draft(kind, target)


def _contexts(n=6, L=24, seed=1):
    return torch.randint(0, 97, (n, L), generator=torch.Generator().manual_seed(seed))


def test_tau_from_alpha_is_the_closed_form():
    assert tau_from_alpha([0.5] * 4) == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625)
    assert tau_from_alpha([1.0, 1.0, 0.0]) == 3.0
    a = 0.7  # i.i.d. positions: (1 - a^(k+1)) / (1 - a) (Leviathan et al. 2023, eq. 1)
    assert tau_from_alpha([a] * 4) == pytest.approx((1 - a ** 5) / (1 - a))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T", [0.0, 1.0])
def test_diagnosis_reads_the_rounds_tau_measures(tiny, kind, T):
    """The hook changes nothing: the rounds and emitted tokens per context equal measure_tau_shared's. At T = 0 the
    acceptance per position equals Σ min(p, q) of the greedy transform (1 when the argmaxes agree); the counts of
    reached positions are the rounds' (position 1 every round, position j+1 when j were accepted). At the first
    drafted position every earlier token is verified in the rounds too, so the verified-prefix pass gives the same
    TV there (the pass reproduces the draft's distribution): a draft fed the wrong memory, features or KV in that
    pass would differ."""
    ctx = _contexts()
    params = SamplingParams(T)
    diag = diagnose_shared(tiny, {"d": _make(kind, tiny)}, ctx, G=12, k=3, params=params, batch_size=4,
                           progress=False)["d"]
    ref = measure_tau_shared(tiny, {"d": _make(kind, tiny)}, ctx, G=12, k=3, params=params, batch_size=4,
                             progress=False)["d"]
    assert diag.rounds == ref.rounds and diag.emitted == ref.emitted and diag.tau == ref.tau
    d = diag.to_dict()
    pos = d["positions"]
    assert pos[0]["reached"] == sum(ref.rounds)  # every round (no AD rounds here) drafts position 1
    assert all(a["reached"] >= b["reached"] for a, b in zip(pos, pos[1:]))
    if T == 0:
        for p in pos:
            if p["reached"]:
                assert p["acceptance"] == pytest.approx(p["expected_acceptance"], abs=1e-9)
    assert pos[0]["verified"] > 0.8 * pos[0]["reached"]
    assert pos[0]["tv_verified"] == pytest.approx(pos[0]["tv"], abs=2e-5)
    if kind == "spire-vocab":
        assert all(p["outside_mass"] > 0.05 for p in pos if p["reached"])  # 37 of 97 tokens have q = 0
    else:
        assert all(p["outside_mass"] == 0 for p in pos if p["reached"])
    json.dumps(d)  # the JSON form is plain


def test_verified_pass_equals_a_teacher_forced_recomputation(tiny):
    """verified_tv at each position equals TV(p, q) recomputed from scratch: the target's softmax over the whole
    sequence and a fresh draft prefilled up to that position, stepping the token before it."""
    from spire.engine.prefill import cache_length, prefill, start_draft

    ctx = _contexts(n=2, L=10).tolist()
    gen = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(7)).tolist()
    kind = "spire-vocab"
    got = verified_tv(tiny, _make(kind, tiny), ctx, gen, (0, 1, 2, 3))
    seqs = [c + g for c, g in zip(ctx, gen)]
    for t in range(5):
        pos = 10 + t  # the position predicted, by the token at pos - 1
        draft = _make(kind, tiny)
        state = prefill(tiny, [s[:pos] for s in seqs], cache_length(tiny, seqs, 1, 1), tuple(range(4)))
        start_draft(draft, tiny, 1, state.cache, state)
        z = draft.step(torch.tensor([[s[pos - 1]] for s in seqs]), torch.full((2, 1), pos - 1))
        full = tiny(torch.tensor(seqs), torch.arange(15)[None].expand(2, 15), tiny.new_cache(2, 32))
        p = F.softmax(full.logits[:, pos - 1].float(), -1)
        tv = 0.5 * (p - F.softmax(z.float(), -1)).abs().sum(-1)
        for b in range(2):
            assert got[(b, pos)] == pytest.approx(float(tv[b]), abs=2e-5), (b, pos)


@pytest.mark.slow
def test_sampled_expected_acceptance_estimates_the_acceptance(tiny):
    """At T = 1 the share of accepted tokens at a position and the mean of Σ min(p, q) there estimate the same
    probability (the acceptance coin is fair): over ~400 drafted first positions they agree within 4 standard
    errors; the draft temperature factor 1 row is that same Σ min(p, q)."""
    ctx = _contexts(n=16, L=16, seed=5)
    diag = diagnose_shared(tiny, {"d": _draft("spire", tiny)}, ctx, G=40, k=2, params=SamplingParams(1.0),
                           batch_size=8, progress=False)["d"]
    d = diag.to_dict()
    p1 = d["positions"][0]
    n, a = p1["reached"], p1["expected_acceptance"]
    assert n > 300
    assert abs(p1["acceptance"] - a) < 4 * (a * (1 - a) / n) ** 0.5
    assert d["draft_temperature"]["1"]["alpha"][0] == pytest.approx(a, abs=1e-6)
    assert 0 <= d["draft_temperature"]["0"]["alpha"][0] <= 1


def test_overlap_by_text_is_the_verified_pass_over_each_text(tiny):
    """overlap_by_text: 1 − the mean verified-prefix TV over every position after the context, on the rounds' output
    and on the given natural continuation, each equal to :func:`verified_tv` over that text (the same draft, the
    same contexts); the two differ (other text); without ``natural`` there is none; a continuation of another
    number of rows is refused."""
    from spire.errors import ConfigError

    ctx = _contexts(n=4, L=16, seed=2)
    natural = torch.randint(0, 97, (4, 10), generator=torch.Generator().manual_seed(9))
    res = diagnose_shared(tiny, {"d": _make("spire", tiny)}, ctx, G=10, k=2, params=SamplingParams(1.0),
                          batch_size=4, progress=False, natural=natural)["d"]
    o = res.to_dict()["overlap_by_text"]
    nat = verified_tv(tiny, _make("spire", tiny), ctx.tolist(), natural.tolist(), (0, 1, 2, 3))
    assert o["natural"]["positions"] == len(nat) == 40
    assert o["natural"]["overlap"] == pytest.approx(1 - sum(nat.values()) / len(nat), abs=1e-6)
    assert o["generated"]["positions"] == 40 and o["generated"]["overlap"] != pytest.approx(o["natural"]["overlap"])
    assert o["natural"]["outside_mass"] == 0 and o["generated"]["outside_mass"] == 0  # the whole vocabulary
    v = diagnose_shared(tiny, {"d": _make("spire-vocab", tiny)}, ctx, G=10, k=2, params=SamplingParams(1.0),
                        batch_size=4, progress=False, natural=natural)["d"].to_dict()["overlap_by_text"]
    out: dict = {}
    verified_tv(tiny, _make("spire-vocab", tiny), ctx.tolist(), natural.tolist(), (0, 1, 2, 3), out)
    full = tiny(torch.cat([ctx, natural], 1), torch.arange(26)[None].expand(4, 26), tiny.new_cache(4, 32))
    p = F.softmax(full.logits[:, 15:25].float(), -1)  # the target at the 10 positions after the context
    want = float(1 - p[..., 20:80].sum(-1).mean())  # the 37 tokens outside the draft's 60 (ids 20..79)
    assert v["natural"]["outside_mass"] == pytest.approx(want, abs=1e-5)
    assert sum(out.values()) / len(out) == pytest.approx(want, abs=1e-5)
    plain = diagnose_shared(tiny, {"d": _make("spire", tiny)}, ctx, G=10, k=2, params=SamplingParams(1.0),
                            batch_size=4, progress=False)["d"].to_dict()
    assert plain["overlap_by_text"] is None
    with pytest.raises(ConfigError, match="do not match"):
        diagnose_shared(tiny, {"d": _make("spire", tiny)}, ctx, G=10, natural=natural[:3], progress=False)


def test_diagnosis_sums_roll_up(tiny):
    d = Diagnosis("x", 1.0, 2)
    d.reached, d.sums["tv"] = [4, 2], [2.0, 0.5]
    assert d.mean("tv") == [0.5, 0.25]
    assert d.mean("tv_verified") == [None, None]


def test_positions_past_the_budget_are_not_counted(tiny):
    """A drafted token past what the request may still emit is thrown away whether accepted or not: with G = 1 every
    round is cut to one token, so only position 1 is reached (a fresh user's report: G = 1 showed every position
    reached and accepted, and a predicted τ of 5 against a measured 1)."""
    diag = diagnose_shared(tiny, {"d": _make("magicdec", tiny)}, _contexts(n=4), G=1, k=3, params=SamplingParams(0.0),
                           batch_size=4, progress=False)["d"].to_dict()
    assert [p["reached"] for p in diag["positions"]] == [4, 0, 0]
    assert diag["tau"] == 1.0


def test_tau_from_alpha_stops_at_a_zero_rate():
    from spire.evaluation.diagnose import Diagnosis

    d = Diagnosis("x", 0.0, 3)
    d.reached, d.sums["acceptance"] = [4, 0, 0], [0.0, 0.0, 0.0]
    assert d.to_dict()["tau_from_acceptance"] == 1.0  # nothing is accepted at 1: positions 2, 3 are never reached
    d.reached, d.sums["acceptance"] = [4, 0, 0], [2.0, 0.0, 0.0]
    assert d.to_dict()["tau_from_acceptance"] is None  # half reach position 2, whose rate is unmeasured


def test_figure_options_refused_or_warned_before_measuring(tmp_path, capsys):
    from tests.helpers import run_cli

    code, _, err = run_cli(capsys, "tau", "--draft", "magicdec", "--diagnose", "--figure", str(tmp_path / "f.txt"))
    assert code != 0 and err.strip().splitlines()[-1].startswith("error: --figure") and "Traceback" not in err
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"format": "spire-tau", "version": 1, "rows": [
        {"draft": "magicdec", "name": "magicdec", "temperature": 0.0, "L": 8, "G": 4, "k": 2, "n_contexts": 1,
         "tau": 2.0, "ci_low": 2.0, "ci_high": 2.0}]}))
    code, _, err = run_cli(capsys, "tau", "--show", str(plain), "--figure", str(tmp_path / "f.png"))
    assert code == 0 and "no row has a diagnosis" in err and not (tmp_path / "f.png").exists()
