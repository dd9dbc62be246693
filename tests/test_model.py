"""spire's Llama forward and its caches against HF transformers and against uncached references."""

import json

import pytest
import torch

from spire.errors import CheckpointError
from spire.kv_cache import SinkWindow, attention_mask
from spire.loading import load_target


def test_logits_match_hf_transformers(smollm2):
    """Float32 logits equal HF LlamaForCausalLM's on the same tokens to 1e-4 (issue 2)."""
    from transformers import AutoModelForCausalLM

    model, tok = smollm2
    from spire.loading import resolve_checkpoint

    hf = AutoModelForCausalLM.from_pretrained(resolve_checkpoint(progress=False), dtype=torch.float32).eval()
    ids = tok("To be, or not to be, that is the question: whether 'tis nobler in the mind",
              return_tensors="pt").input_ids
    ids = torch.cat([ids, ids.flip(1)])
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.no_grad():
        ours = model(ids, pos).logits
        ref = hf(ids).logits.float()
    assert ours.shape == (2, ids.shape[1], 49152)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert model.num_body_params() == 30 * 3_540_096


def test_cached_decoding_equals_full_forward(tiny):
    torch.manual_seed(0)
    ids = torch.randint(0, 97, (2, 40))
    pos = torch.arange(40)[None].expand(2, 40)
    full = tiny(ids, pos).logits
    cache = tiny.new_cache(2, 64)
    parts = [tiny(ids[:, :30], pos[:, :30], cache).logits]
    parts.append(tiny(ids[:, 30:35], pos[:, 30:35], cache).logits)  # a verify-sized block
    for t in range(35, 40):
        parts.append(tiny(ids[:, t:t + 1], pos[:, t:t + 1], cache).logits)
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


def test_rollback_by_overwrite(tiny):
    """Writing garbage past the committed length and then re-writing gives the clean result."""
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (1, 20))
    pos = torch.arange(20)[None]
    clean = tiny(ids, pos).logits[:, -1]
    cache = tiny.new_cache(1, 32)
    tiny(ids[:, :15], pos[:, :15], cache)
    tiny(torch.randint(0, 97, (1, 8)), torch.arange(15, 23)[None], cache)  # rejected block
    out = tiny(ids[:, 15:], pos[:, 15:], cache).logits[:, -1]
    torch.testing.assert_close(out, clean, atol=1e-5, rtol=1e-5)


def test_sink_window_mask_and_cached_view(tiny):
    """CASES.md 7: sink 1, window 4: cached steps equal a non-cached forward with the same mask."""
    view = SinkWindow(sink=1, window=4)
    m = attention_mask(torch.tensor([[6]]), torch.arange(8), view)[0, 0, 0]
    assert m.tolist() == [True, False, False, True, True, True, True, False]
    torch.manual_seed(2)
    ids = torch.randint(0, 97, (1, 10))
    pos = torch.arange(10)[None]
    ref = tiny(ids, pos, view=view).logits
    cache = tiny.new_cache(1, 16)
    tiny(ids[:, :6], pos[:, :6], cache, view=view)
    for t in range(6, 10):
        step = tiny(ids[:, t:t + 1], pos[:, t:t + 1], cache, view=view).logits
        torch.testing.assert_close(step[:, 0], ref[:, t], atol=1e-5, rtol=1e-5)


def test_bad_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_target(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_target(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 10}))
    with pytest.raises(CheckpointError, match="lacks the key"):
        load_target(tmp_path)
    with pytest.raises(CheckpointError, match="not found"):
        load_target(tmp_path / "x.gguf")
