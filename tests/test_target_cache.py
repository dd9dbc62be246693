"""The offline target cache (training from stored target outputs) and the draft vocabulary (a SPIRe head over
the N most frequent tokens): exact against live training, safe to interrupt, lossless in decoding."""

import json
import shutil
from collections import namedtuple

import numpy as np
import pytest
import torch

from spire.drafts.spire import SpireConfig, SpireDraft, SpireDraftModel
from spire.drafts.vocab import frequent_tokens, probable_tokens
from spire.errors import ConfigError, DataError
from spire.sampling import SamplingParams, probs_from_logits
from tests.oracle import generate
from spire.training import sources
from spire.training.distill import TrainConfig, train_draft
from spire.training.sources import LiveTarget, TargetCache
from tests.conftest import make_tiny
from tests.test_lossless import _chi2
from tests.train_worker import RepeatingData, config

Split = namedtuple("Split", "tokens")


class TokenLikeData(RepeatingData):
    """RepeatingData with the two things a cache and a draft vocabulary read: a data key and token counts."""

    def __init__(self, raise_at: int | None = None):
        super().__init__()
        self.manifest = {"key": "repeating-97"}
        self.train = Split(self.seqs.flatten().numpy())
        self.calls, self.raise_at = 0, raise_at

    def sample_train_batch(self, batch_size, seq_len, generator):
        self.calls += 1
        if self.calls == self.raise_at:
            raise KeyboardInterrupt
        return super().sample_train_batch(batch_size, seq_len, generator)


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _losses(run) -> list[float]:
    lines = [json.loads(ln) for ln in (run / "train_log.jsonl").read_text().splitlines() if ln.strip()]
    return [e["loss"] for e in lines if e["event"] == "train"]


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("SPIRE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "target-cache"


@pytest.mark.slow
@pytest.mark.parametrize("vocab_size", [None, 40])
def test_training_from_a_float32_cache_equals_live_training_bit_for_bit(tmp_path, tiny, cache_root, vocab_size):
    """3 stored batches, 7 steps (epochs over them): every parameter, the AdamW state and every logged loss are
    identical to a live run over the same batches."""
    def cfg(cache):
        c = config("spire", max_steps=7, batch=4)
        c.data_steps, c.target_cache = 3, cache
        c.spire = SpireConfig(n_draft_layers=2, window=8, vocab_size=vocab_size)
        return c
    live, _ = train_draft(tiny, TokenLikeData(), tmp_path / "live", cfg(None), progress=False)
    cached, _ = train_draft(tiny, TokenLikeData(), tmp_path / "cached", cfg("float32"), progress=False)
    assert len(list(cache_root.iterdir())) == 1  # built once, complete
    a, b = _params(live), _params(cached)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert _losses(tmp_path / "live") == _losses(tmp_path / "cached")
    opt_live = torch.load(tmp_path / "live" / "checkpoint" / "optimizer.pt", weights_only=True)
    opt_cached = torch.load(tmp_path / "cached" / "checkpoint" / "optimizer.pt", weights_only=True)
    for i, st in opt_live["state"].items():
        for name, t in st.items():
            assert torch.equal(t, opt_cached["state"][i][name]), (i, name)
    # the epochs really repeat: step 4 trains on the batch of step 1
    live_src = LiveTarget(tiny, TokenLikeData(), (), False, 4, 32, 0, data_steps=3)
    assert torch.equal(live_src.tokens(3), live_src.tokens(0)) and not torch.equal(live_src.tokens(1),
                                                                                     live_src.tokens(0))


def test_bfloat16_cache_is_close_to_live(tmp_path, tiny, cache_root):
    """The compact cache rounds hidden states to bf16: the run stays within a stated tolerance of the live one
    (losses within 2 %, weights within 1e-2), and its hidden states take half the bytes of a float32 cache."""
    def cfg(cache):
        c = config("spire", max_steps=5, batch=4)
        c.data_steps, c.target_cache = 5, cache
        return c
    live, _ = train_draft(tiny, TokenLikeData(), tmp_path / "live", cfg(None), progress=False)
    cached, _ = train_draft(tiny, TokenLikeData(), tmp_path / "bf16", cfg("bfloat16"), progress=False)
    np.testing.assert_allclose(_losses(tmp_path / "bf16"), _losses(tmp_path / "live"), rtol=2e-2)
    for (k, x), y in zip(_params(live).items(), _params(cached).values()):
        torch.testing.assert_close(y, x, rtol=0, atol=1e-2, msg=k)
    (folder,) = cache_root.iterdir()
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["dtype"] == "bfloat16"
    assert np.load(folder / "hidden_3.npy", mmap_mode="r").dtype == np.uint16
    assert np.load(folder / "final.npy", mmap_mode="r").dtype == np.float32  # the teacher stays exact
    assert meta["bytes"] == sum(f.stat().st_size - 128 for f in folder.glob("*.npy"))  # 128-byte .npy headers
    teacher = 5 * 4 * 32 * (4 + 49 * 4)  # tokens, final hidden state and log Z
    assert TargetCache.size_bytes(5, 4, 32, 48, 2, True, "float32") - teacher == 2 * (meta["bytes"] - teacher)


def test_an_interrupted_build_never_reads_as_a_cache_and_resumes(tmp_path, tiny):
    """Killed after 20 of 40 batches (progress recorded every 16): no cache folder exists, only <key>.partial;
    the next build resumes at batch 16 and its arrays equal an uninterrupted build's."""
    root = tmp_path / "a"
    kw = dict(layers=(2, 3), teacher=True, batch_size=2, seq_len=32, seed=0, steps=40, dtype="float32",
              progress=False, log=None)
    with pytest.raises(KeyboardInterrupt):
        TargetCache.build(tiny, TokenLikeData(raise_at=21), root=root, **kw)
    (part,) = root.iterdir()
    assert part.name.endswith(".partial")
    assert json.loads((part / "progress.json").read_text()) == {"steps_done": 16}
    with pytest.raises(DataError, match="not a complete target cache"):
        TargetCache(part)
    data = TokenLikeData()
    resumed = TargetCache.build(tiny, data, root=root, **kw)
    assert data.calls == 24  # batches 16..39 only
    clean = TargetCache.build(tiny, TokenLikeData(), root=tmp_path / "b", **kw)
    assert sorted(p.name for p in root.iterdir()) == [resumed.path.name]
    for name in ("tokens", "hidden_2", "hidden_3", "final", "logz"):
        assert np.array_equal(resumed._arrays[name], clean._arrays[name]), name


def test_cache_refuses_to_start_without_disk_space(tmp_path, tiny, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(sources.shutil, "disk_usage", lambda p: Usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(DataError, match=r"needs 0\.\d\d GiB .* free"):
        TargetCache.build(tiny, TokenLikeData(), (1,), True, 4, 32, 0, 100, "float32", root=tmp_path,
                          progress=False, log=None)
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind


def test_cache_settings_are_checked():
    with pytest.raises(ConfigError, match="give --cache-steps with --target-cache"):
        TrainConfig(target_cache="float32").validate()
    with pytest.raises(ConfigError, match="--target-cache must be one of"):
        TrainConfig(target_cache="fp8", data_steps=4).validate()
    with pytest.raises(ConfigError, match=r"--cache-steps must be >= 1, got 0"):
        TrainConfig(data_steps=0).validate()


# -- draft vocabulary --------------------------------------------------------------------------------------

def test_frequent_tokens_by_count_then_id():
    ids = frequent_tokens(np.array([5, 5, 5, 2, 2, 9, 9, 7]), 3, 10)
    assert ids.tolist() == [2, 5, 9]  # 5 (3x), then 2 and 9 (2x each) before 7 (1x)
    assert frequent_tokens(np.array([3]), 3, 10).tolist() == [0, 1, 3]  # unseen ids fill in id order
    with pytest.raises(ConfigError):
        frequent_tokens(np.array([1]), 11, 10)


def test_probable_tokens_are_the_targets_most_probable_ids(tiny):
    """The N ids of largest Σ_t p(v | x_<t), against the same sum decoded one token at a time through the KV cache
    (another code path than the full-attention forward probable_tokens runs)."""
    windows = torch.randint(0, 97, (5, 12), generator=torch.Generator().manual_seed(3))
    mass = torch.zeros(97, dtype=torch.float64)
    cache = tiny.new_cache(5, 12)
    for t in range(12):
        logits = tiny(windows[:, t:t + 1], torch.full((5, 1), t), cache).logits
        mass += torch.softmax(logits.double(), -1).sum((0, 1))
    want = sorted(torch.argsort(mass, descending=True)[:20].tolist())
    assert probable_tokens(tiny, windows, 20, rows=2).tolist() == want
    assert probable_tokens(tiny, windows, 97).tolist() == list(range(97))
    with pytest.raises(ConfigError):
        probable_tokens(tiny, windows, 98)


def test_a_mass_vocabulary_is_chosen_by_the_target_not_by_counts(tiny):
    data = TokenLikeData()
    cfg = config("spire", 1, 2)
    cfg.draft_config.vocab_size, cfg.draft_config.vocab_from = 30, "mass"
    model = SpireDraftModel.for_training(tiny, cfg, data)
    windows = data.sample_train_batch(64, cfg.seq_len, torch.Generator().manual_seed(cfg.seed))
    assert model.vocab.tolist() == probable_tokens(tiny, windows, 30).tolist()
    assert model.vocab.tolist() != frequent_tokens(data.train.tokens, 30, 97).tolist()
    with pytest.raises(ConfigError, match="chosen by frequency or mass"):
        SpireConfig(n_draft_layers=2, vocab_size=30, vocab_from="counts").validate(4, 97)


def test_draft_vocabulary_head_and_maps(tiny):
    vocab = torch.tensor([0, 3, 7, 50, 96])
    m = SpireDraftModel(tiny, SpireConfig(n_draft_layers=2, window=8, vocab_size=5), vocab)
    x = torch.randn(2, 3, tiny.cfg.d_model)
    sub = m.logits(x)
    assert sub.shape == (2, 3, 5)
    full = tiny.lm_head(m.norm(x))
    torch.testing.assert_close(sub, full[..., vocab], rtol=1e-5, atol=1e-5)
    back = m.to_target_vocab(sub)
    assert back.shape == (2, 3, 97) and torch.isinf(back).sum() == 2 * 3 * 92
    assert torch.equal(back[..., vocab], sub)
    with torch.no_grad():  # inference: the native scatter where the kernels are built, = index_copy_
        ref = sub.new_full((2, 3, 97), float("-inf")).index_copy_(-1, vocab, sub)
        assert torch.equal(m.to_target_vocab(sub), ref) and torch.equal(back, ref)
    with torch.enable_grad():  # under autograd the torch op, gradients flow
        g = sub.detach().clone().requires_grad_(True)
        m.to_target_vocab(g)[..., vocab].sum().backward()
        assert torch.equal(g.grad, torch.ones_like(sub))
    assert m.to_draft_ids(torch.tensor([3, 4, 96])).tolist() == [1, -100, 4]
    with pytest.raises(ConfigError, match="distinct token ids"):
        SpireDraftModel(tiny, SpireConfig(n_draft_layers=2, vocab_size=3), torch.tensor([1, 1, 2]))
    with pytest.raises(ConfigError, match="larger than the target"):
        SpireDraftModel(tiny, SpireConfig(n_draft_layers=2, vocab_size=98))


def test_draft_vocabulary_survives_save_and_load(tmp_path, tiny):
    vocab = torch.tensor([1, 4, 9, 16, 25, 36])
    m = SpireDraftModel(tiny, SpireConfig(n_draft_layers=2, window=8, vocab_size=6), vocab)
    m.save(tmp_path / "d.safetensors")
    back = SpireDraftModel.load(tmp_path / "d.safetensors", tiny)
    assert torch.equal(back.vocab, vocab)
    x = torch.randn(1, 2, tiny.cfg.d_model)
    assert torch.equal(back.logits(x), m.logits(x))
    from spire.errors import CheckpointError
    for bad in (torch.tensor([1, 4, 9, 16, 25, 97]), torch.tensor([1, 4, 4, 16, 25, 36])):  # past V; a repeat
        m.vocab.copy_(bad)
        m.save(tmp_path / "bad.safetensors")
        with pytest.raises(CheckpointError, match="distinct token ids in"):
            SpireDraftModel.load(tmp_path / "bad.safetensors", tiny)
    # a vocabulary of the wrong length, of another dtype, or missing: one CheckpointError, not a traceback
    from spire.formats.draft_file import read_draft_file, write_draft_file
    meta, state = read_draft_file(tmp_path / "d.safetensors")
    for name, change in (("short", lambda st: st.update(vocab=st["vocab"][:-1])),
                         ("float", lambda st: st.update(vocab=st["vocab"].double() + 0.5)),
                         ("missing", lambda st: st.pop("vocab"))):
        st = dict(state)
        change(st)
        write_draft_file(tmp_path / f"{name}.safetensors", st, meta)
        with pytest.raises(CheckpointError, match="draft vocabulary must be|does not fit its own configuration"):
            SpireDraftModel.load(tmp_path / f"{name}.safetensors", tiny)


def _reduced_draft(target, n: int, seed: int = 0) -> SpireDraft:
    g = torch.Generator().manual_seed(seed)
    vocab = torch.randperm(target.cfg.vocab_size, generator=g)[:n].sort().values
    return SpireDraft(SpireDraftModel(target, SpireConfig(n_draft_layers=2, window=4, vocab_size=n), vocab))


def test_greedy_sd_with_a_draft_vocabulary_equals_ad(tiny):
    prompts = [[5, 17, 42], list(range(1, 40)), [8]]
    ad = generate(tiny, prompts, 24)
    for n in (8, 60):  # the argmax is often outside 8 tokens: rounds reject at 0, and accept when it is inside
        sd = generate(tiny, prompts, 24, draft=_reduced_draft(tiny, n), k=4)
        assert sd.tokens == ad.tokens, n


@pytest.mark.slow
def test_sampling_with_a_draft_vocabulary_matches_the_target():
    """At T = 1 (and with top-k / top-p) the first two generated tokens follow the target's distribution when
    the draft gives q = 0 to most tokens (residual sampling must reach them)."""
    from tests.test_lossless import _exact_marginals

    target = make_tiny(seed=11)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.35)
    prompt = [5, 17, 42, 8, 60, 3, 71]
    for params in (SamplingParams(1.0), SamplingParams(0.8, top_k=20, top_p=0.9)):
        p1, p2 = _exact_marginals(target, prompt, params)
        res = generate(target, [prompt] * 3000, 3, draft=_reduced_draft(target, 30, seed=2), k=3, params=params,
                       generator=torch.Generator().manual_seed(7))
        assert _chi2(np.array([t[0] for t in res.tokens]), p1) > 1e-3
        assert _chi2(np.array([t[1] for t in res.tokens]), p2) > 1e-3
        assert res.tau > 1.0  # the draft's tokens are accepted at times
    # the same check rejects samples that never leave the draft vocabulary
    inside = np.zeros(97, bool)
    inside[_reduced_draft(target, 30, seed=2).model.vocab.numpy()] = True
    p = probs_from_logits(target(torch.tensor([prompt]), torch.arange(7)[None]).logits[0, -1],
                          SamplingParams(1.0)).numpy().astype(float)
    q = np.where(inside, p, 0) / p[inside].sum()
    assert _chi2(np.random.default_rng(0).choice(97, size=3000, p=q), p) < 1e-6


def test_a_cache_holding_more_layers_serves_a_run_needing_fewer(tmp_path, tiny):
    """Ablations reuse the main run's cache: a request for a subset of its layers (or none, teacher only) opens
    it instead of running the target again; a request for a layer it lacks builds a new one."""
    kw = dict(batch_size=2, seq_len=32, seed=0, steps=3, dtype="bfloat16", root=tmp_path, progress=False, log=None)
    full = TargetCache.build(tiny, TokenLikeData(), (1, 2, 3), True, **kw)
    data = TokenLikeData()
    assert TargetCache.build(tiny, data, (3,), True, **kw).path == full.path
    assert TargetCache.build(tiny, data, (), True, **kw).path == full.path
    assert data.calls == 0
    other = TargetCache.build(tiny, data, (0,), True, **kw)
    assert other.path != full.path and data.calls == 3
    tb = full.batch(4, slice(1, 2))  # step 4 of 3 stored batches: batch 1, second row
    assert tb.tokens.shape == (1, 32) and set(tb.hidden) == {1, 2, 3} and tb.final.shape == (1, 32, 48)
    live = LiveTarget(tiny, TokenLikeData(), (1, 2, 3), True, 2, 32, 0).batch(1, slice(1, 2))
    assert torch.equal(tb.tokens, live.tokens)
    torch.testing.assert_close(tb.hidden[2], live.hidden[2], rtol=1e-2, atol=1e-2)  # bf16 storage
    torch.testing.assert_close(tb.final, live.final, rtol=0, atol=1e-5)  # float32
    # log Z is stored in float32 (the live pass here ran on one row, the cache's on two: float32 rounding apart)
    torch.testing.assert_close(tb.logz, live.logz, rtol=0, atol=1e-5)
