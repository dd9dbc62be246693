"""Peer check: spire's greedy output equals HF transformers' `generate`, with and without `assistant_model`
(batch 1, float32; issue 3)."""

import pytest
import torch

from spire.drafts.magicdec import MagicDecDraft
from tests.oracle import generate


@pytest.fixture(scope="module")
def hf_model(smollm2):
    from transformers import AutoModelForCausalLM

    from spire.loading import resolve_checkpoint

    return AutoModelForCausalLM.from_pretrained(resolve_checkpoint(progress=False), dtype=torch.float32).eval()


@pytest.mark.slow
@pytest.mark.parametrize("prompt", ["The history of the Roman Empire", "def quicksort(xs):\n"])
def test_greedy_equals_hf_generate(smollm2, hf_model, prompt):
    model, tok = smollm2
    ids = tok(prompt, return_tensors="pt").input_ids
    kw = dict(max_new_tokens=24, do_sample=False, pad_token_id=tok.eos_token_id, eos_token_id=None)
    with torch.no_grad():
        hf_plain = hf_model.generate(ids, **kw)[0, ids.shape[1]:].tolist()
        hf_assisted = hf_model.generate(ids, assistant_model=hf_model, **kw)[0, ids.shape[1]:].tolist()
    ours_ad = generate(model, [ids[0].tolist()], 24).tokens[0]
    ours_sd = generate(model, [ids[0].tolist()], 24, draft=MagicDecDraft(1, 16), k=4).tokens[0]
    assert hf_plain == hf_assisted == ours_ad == ours_sd
