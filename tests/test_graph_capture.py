"""Graph capture (issue 53, item 3): each draft's step, the target's verify forward and the vLLM plugin's forward
trace with ``torch.compile(fullgraph=True, dynamic=False)`` for a fixed (B, k) with no graph break, and one graph
serves every position (``error_on_recompile``): what a GPU run needs to capture one CUDA graph per batch size and k.
Traced without a span, a forward reads the whole cache under the mask (:class:`spire.fastpath.CacheAccess`), so its
shapes do not follow the positions. The graphs are traced with the ``eager`` backend (dynamo finds every graph
break and recompile; inductor's code generation adds a minute per graph on two cores and checks nothing more here),
and their logits are held to the eager forward's.

The plugin's forward needs vLLM, which lives in its own venv (``.venv-vllm``): its three vLLM names are stood in
for here (the base class as ``nn.Module``, vLLM's paged attention as plain causal attention over the call's own
slots, under the same sliding window), so what is traced and run on meta is spire's own part of it.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

from spire.drafts.eagle3 import Eagle3Config, Eagle3Draft, Eagle3DraftModel
from spire.drafts.magicdec import MagicDecDraft
from spire.drafts.ngram import NgramDraft
from spire.drafts.spire import SpireConfig, SpireDraft, SpireDraftModel
from spire.drafts.vanilla import VanillaDraft, build_vanilla
from tests.conftest import make_tiny

B, K, L, MAX_LEN = 2, 3, 12, 64


def compiled(fn):
    return torch.compile(fn, fullgraph=True, dynamic=False, backend="eager")


@pytest.fixture(scope="module")
def target():
    return make_tiny()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
    torch._dynamo.reset()


def test_verify_forward_is_one_graph_for_every_position(target):
    """The target's verify forward over k + 1 positions: one graph, no break, no recompile at the next round's
    positions (rows at different lengths), logits equal to the eager forward's."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 97, (B, L + 8), generator=g)
    caches = [target.new_cache(B, MAX_LEN) for _ in range(2)]
    for c in caches:
        target(tokens[:, :L], torch.arange(L)[None].expand(B, L), c)
    verify = compiled(lambda t, p: target(t, p, caches[0]).logits)
    for p0 in ((L, L - 3), (L + 2, L - 1)):  # two rounds: the positions move, the graph stays
        vpos = torch.tensor(p0)[:, None] + torch.arange(K + 1)
        vt = tokens.gather(1, vpos)
        torch.testing.assert_close(verify(vt, vpos), target(vt, vpos, caches[1]).logits, rtol=1e-5, atol=1e-5)


def _drafts(target) -> dict:
    g = torch.Generator().manual_seed(0)
    vocab = torch.randperm(97, generator=g)[:60].sort().values
    return {"spire": lambda: SpireDraft(SpireDraftModel(target, SpireConfig(n_draft_layers=2, window=4))
                                        .requires_grad_(False)),
            "spire-features": lambda: SpireDraft(SpireDraftModel(target, SpireConfig(
                n_draft_layers=2, window=4, feature_input=True)).requires_grad_(False)),
            "magicdec": lambda: MagicDecDraft(1, 4),
            "vanilla": lambda: VanillaDraft(build_vanilla(target, 1).eval().requires_grad_(False)),
            "eagle3": lambda: Eagle3Draft(Eagle3DraftModel(target, Eagle3Config(draft_vocab=60, layers=(1, 2, 4)),
                                                           vocab).eval().requires_grad_(False)),
            "ngram": lambda: NgramDraft()}


@pytest.mark.parametrize("kind", ["spire", "spire-features", "magicdec", "vanilla", "eagle3", "ngram"])
def test_draft_step_is_one_graph_for_every_position(target, kind):
    """k steps of each draft, traced once: no break, no recompile as the positions move; logits equal to an eager
    twin's (the same draft, built and fed the same way)."""
    make = _drafts(target)[kind]
    twins = []
    for _ in range(2):
        torch.manual_seed(0)  # the same initial weights
        twins.append(make())
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 97, (B, L), generator=g)
    tokens[:, L // 2:] = tokens[:, : L - L // 2]  # a repeat for the n-gram draft to find
    pos = torch.arange(L)[None].expand(B, L)
    for d in twins:
        cache = target.new_cache(B, MAX_LEN)
        d.start(target, cache, B, MAX_LEN, K)
        d.observe(tokens, pos, target(tokens, pos, cache, hidden_layers=d.hidden_layers))
    step = compiled(twins[0].step)
    tok = tokens[:, -1:].clone()  # (B, 1) contiguous, as each step's argmax
    p0 = torch.tensor([[L - 1], [L - 1]])
    for j in range(K):
        z = step(tok, p0 + j)
        torch.testing.assert_close(z, twins[1].step(tok, p0 + j), rtol=1e-5, atol=1e-5)
        tok = z.argmax(-1, keepdim=True)


# ------------------------------------------------------------------------------------- the vLLM plugin's forward

class _Attention(nn.Module):
    """vLLM's ``Attention`` as the plugin calls it, stood in for: q (T, H·D), k, v (T, KV·D) of one sequence's slots
    -> (T, H·D), slot t reading slots t - W' + 1 .. t (vLLM's sliding window of W' slots)."""

    def __init__(self, H, D, scale, num_kv_heads, cache_config=None, per_layer_sliding_window=None, prefix=""):
        super().__init__()
        self.H, self.D, self.KV, self.scale, self.window = H, D, num_kv_heads, scale, per_layer_sliding_window

    def forward(self, q, k, v):
        T = q.shape[0]
        q, k, v = (x.view(T, -1, self.D).transpose(0, 1) for x in (q, k, v))
        t = torch.arange(T, device=q.device)
        mask = t[None] <= t[:, None]
        if self.window is not None:
            mask = mask & (t[None] > t[:, None] - self.window)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return a.transpose(0, 1).reshape(T, -1)


@pytest.fixture
def vllm_spire(monkeypatch):
    """spire.integrations.vllm_spire imported over stand-ins for its three vLLM names."""
    names = {"vllm": {}, "vllm.config": {"VllmConfig": object},
             "vllm.model_executor": {}, "vllm.model_executor.layers": {},
             "vllm.model_executor.layers.attention": {"Attention": _Attention},
             "vllm.model_executor.models": {}, "vllm.model_executor.models.llama_eagle3": {
                 "Eagle3LlamaForCausalLM": nn.Module}}
    for name, attrs in names.items():
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))
    monkeypatch.delitem(sys.modules, "spire.integrations.vllm_spire", raising=False)
    import spire.integrations.vllm_spire as mod

    yield mod
    sys.modules.pop("spire.integrations.vllm_spire", None)


def _plugin(mod, device=None, dtype=torch.float32):
    c = dict(d_model=48, n_heads=4, n_kv_heads=2, d_head=12, d_ff=96, rms_eps=1e-5, source_layers=[1, 3],
             n_target_layers=4, vocab_size=97, rope_theta=10000.0)
    hf = types.SimpleNamespace(spire_vllm={"plugin_format": 1, "shape": c, "window": 5, "draft_vocab_size": 60})
    target_hf = types.SimpleNamespace(num_hidden_layers=4, hidden_size=48, vocab_size=97, num_attention_heads=4,
                                      num_key_value_heads=2)
    cfg = types.SimpleNamespace(speculative_config=types.SimpleNamespace(
        draft_model_config=types.SimpleNamespace(hf_config=hf)),
        model_config=types.SimpleNamespace(hf_config=target_hf, model="target"), cache_config=None)
    with torch.device(device or "cpu"):
        model = mod.SpireDraftForVllm(vllm_config=cfg)
        model.model.embed_tokens = nn.Embedding(97, 48)  # what the proposer shares: the target's embedding
    model._probed = True  # the start-up check ran (load_weights, from the target's files)
    if device is None:
        torch.manual_seed(0)
        for p in model.parameters():
            torch.nn.init.normal_(p, 0, 0.2)
        model.vocab.copy_(torch.randperm(97)[:60].sort().values)
    return model.to(dtype).eval().requires_grad_(False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_vllm_plugin_forward_on_meta(vllm_spire, dtype):
    """The plugin's forward and logits (spire's part of them) on meta: nothing made on the CPU, nothing read back."""
    model = _plugin(vllm_spire, torch.device("meta"), dtype)
    T = 5
    ids = torch.zeros(T, dtype=torch.long, device="meta")
    h, mem = model(ids, torch.arange(T, device="meta"), torch.zeros(T, 2 * 48, device="meta", dtype=dtype))
    assert h.device.type == mem.device.type == "meta" and tuple(mem.shape) == (T, 96)
    logits = model.compute_logits(h)
    assert logits.device.type == "meta" and tuple(logits.shape) == (T, 97) and logits.dtype == torch.float32


def test_vllm_plugin_forward_is_one_graph(vllm_spire):
    """The plugin's forward and logits for a fixed number of slots trace as one graph at any positions, equal to
    the eager forward."""
    model = _plugin(vllm_spire)
    T = 4

    def run(ids, positions, hidden):
        h, mem = model(ids, positions, hidden)
        return model.compute_logits(h), mem

    g = torch.Generator().manual_seed(2)
    traced = compiled(run)
    for p0 in (0, 7):
        args = (torch.randint(0, 97, (T,), generator=g), torch.arange(p0, p0 + T), torch.randn(T, 96, generator=g))
        for a, b in zip(traced(*args), run(*args)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
