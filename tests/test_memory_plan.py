"""The memory plan (spire.memory_plan, issue 53 item 5): its byte counts against the real tensors' bytes, the
refusal naming the largest batch that fits, and `spire train` / `spire serve` refusing before loading."""

from __future__ import annotations

import re
import types

import numpy as np
import pytest
import torch

from spire import fastpath
from spire.errors import ConfigError
from spire.memory_plan import (check_fits, fused_copy_bytes, kv_bytes, largest_batch, meta_target, module_bytes,
                               parse_bytes, serve_plan, train_planner)
from tests.conftest import make_tiny, tiny_config


def _real_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def test_weights_kv_and_fused_copies_are_exact_byte_counts():
    """The meta target's bytes equal the real model's storages (tied head once, buffers included), in float32 and
    bf16; kv_bytes equals a real KVCache's; fused_copy_bytes equals the copies the fast path keeps after a decode
    forward."""
    cfg = tiny_config()
    real = make_tiny()
    assert module_bytes(meta_target(cfg)) == _real_bytes([*real.parameters(), *real.buffers()])
    assert module_bytes(meta_target(cfg), torch.bfloat16) == _real_bytes(
        [*real.to(torch.bfloat16).parameters(), *real.buffers()]) and real.float() is real
    cache = real.new_cache(3, 40)
    assert kv_bytes(cfg.n_layers, 3, cfg.n_kv_heads, 40, cfg.d_head) == _real_bytes([*cache.k, *cache.v,
                                                                                    cache.positions])
    real(torch.tensor([[1, 2, 3] * 20]), torch.arange(60)[None])  # a prefill: the torch path's "N" copies
    kept = sum(w.numel() * w.element_size() for layer in real.layers for m in (layer.self_attn, layer.mlp)
               for wc in fastpath.weight_copies(m).values() for layout, (_, w) in wc._store.items()
               if layout == "N")  # (the CPU kernels' packed layouts are CPU-only)
    assert kept == fused_copy_bytes(cfg)


def test_train_plan_counts_the_real_drafts_parameters():
    """Draft weights, gradients and AdamW state are 4 + 4 + 8 bytes per trainable parameter of the draft the
    trainer builds (counted here on the real one), and the plan grows with the batch by the activation terms."""
    from spire.drafts.spire import SpireConfig
    from spire.training.distill import TrainConfig, _build_model

    cfg = tiny_config()
    tc = TrainConfig(batch_size=2, seq_len=16, bf16=False, draft_config=SpireConfig(n_draft_layers=2, vocab_size=64))
    data = types.SimpleNamespace(train=types.SimpleNamespace(tokens=np.arange(cfg.vocab_size)))
    draft = _build_model(make_tiny(), tc, data)
    n = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    plan = train_planner(cfg, tc)
    p2, p4 = plan(2), plan(4)
    assert p2.parts["draft weights"] == 4 * n and p2.parts["gradients"] == 4 * n
    assert p2.parts["AdamW state"] == 8 * n
    assert p2.parts["target weights"] == module_bytes(make_tiny())
    # the live teacher's logits: (B, T, V) float32 per batch row
    assert p4.parts["teacher batch"] - p2.parts["teacher batch"] >= 2 * 16 * cfg.vocab_size * 4
    assert p4.total > p2.total


def test_refusal_names_the_largest_batch_that_fits():
    cfg = tiny_config()
    plan = lambda s: serve_plan(cfg, s, 64, 4, 16, "magicdec")  # noqa: E731
    memory = plan(5).total + 1
    assert largest_batch(plan, memory, 100) == 5
    assert check_fits(plan, 5, memory, "cuda").batch == 5
    with pytest.raises(ConfigError, match=r"the largest --max-running that fits is 5 \(a smaller --max-len also "
                                          r"shrinks it\)$") as e:
        check_fits(plan, 9, memory, "cuda")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="nothing fits"):
        check_fits(plan, 9, 1000, "cuda")
    assert parse_bytes("24GiB") == 24 * 2**30 and parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes("4096") == 4096
    with pytest.raises(ConfigError):
        parse_bytes("lots")


@pytest.mark.parametrize("command", ["train", "serve"])
def test_cli_refuses_before_loading(smollm2, tmp_path, capsys, monkeypatch, command):
    """With a stated device memory too small, `spire train` and `spire serve` exit 2 with one error line naming the
    largest batch that fits, before the target loads."""
    import spire.loading
    from spire.cli import main

    def no_load(*a, **kw):
        raise AssertionError("loaded the target")

    monkeypatch.setattr(spire.loading, "load_target", no_load)
    monkeypatch.setattr("spire.commands.train.load_target", no_load)
    if command == "train":
        args = ["train", "--device", "cpu", "--device-memory", "2.5GiB", "--batch-size", "64", "--seq-len", "512",
                "--out", str(tmp_path / "run")]
    else:
        monkeypatch.setenv("SPIRE_DEVICE_MEMORY", "2GiB")
        args = ["serve", "--max-running", "64", "--max-len", "8192", "--draft", "magicdec", "--port", "8761"]
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err.strip().splitlines()
    flag = "--batch-size" if command == "train" else "--max-running"
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: spire " + command), err
    best = int(re.search(f"the largest {flag} that fits is ([0-9]+)", err[0]).group(1))
    assert 1 <= best < 64
    # where the limit came from: the option, or the environment variable a user may have forgotten
    assert ("(--device-memory)" if command == "train" else "($SPIRE_DEVICE_MEMORY)") in err[0], err[0]


def test_saved_activations_counted_on_meta_equal_the_real_ones():
    """saved_activation_bytes (the draft's training forward on the meta device) equals the bytes autograd saves
    when the same forward runs on real CPU tensors (each storage once, parameters and inputs left out), the CPU
    taking the attention a GPU takes (SDPA, math backend: what meta decomposes to) instead of its own grouped one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from spire import backend
    from spire.drafts.spire import SpireConfig
    from spire.memory_plan import _trainable_draft_on_meta, saved_activation_bytes
    from spire.training.distill import TrainConfig, _build_model

    cfg = tiny_config()
    tc = TrainConfig(batch_size=3, seq_len=32, bf16=False, draft_config=SpireConfig(n_draft_layers=2, vocab_size=64))
    data = types.SimpleNamespace(train=types.SimpleNamespace(tokens=np.arange(cfg.vocab_size)))
    real = _build_model(make_tiny(), tc, data)
    backend.use(real, backend.of(real).replace(grouped_attention=False))
    tokens = torch.randint(0, cfg.vocab_size, (3, 32), generator=torch.Generator().manual_seed(0))
    hidden = {j: torch.randn(3, 32, cfg.d_model) for j in real.target_layers()}
    skip = {p.untyped_storage().data_ptr() for p in real.parameters()}
    skip |= {h.untyped_storage().data_ptr() for h in hidden.values()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), sdpa_kernel(SDPBackend.MATH):
        real.train_logits(tokens, hidden, tc.k)
    meta = _trainable_draft_on_meta(meta_target(cfg), tc)
    assert saved_activation_bytes(meta, cfg, 3, 32, tc.k) == sum(seen.values()) > 0


def test_serve_refuses_cuda_without_a_gpu(capsys):
    """`spire serve --device cuda` on a torch without CUDA: one error line, before loading."""
    from spire.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as e:
        main(["serve", "--device", "cuda", "--draft", "magicdec", "--port", "8762"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"error: --device cuda, but this torch ({torch.__version__}) sees no CUDA "
                                         "device"], err
