"""Test-only drafts, the CLI run in-process, and helpers several test modules share."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spire.backend import Backend
from spire.cli import main
from spire.drafts.base import Draft
from spire.model import Transformer
from spire.training.losses import LossTerms, mixed_loss_logp


class NoisyTargetDraft(Draft):
    """The target itself with its own full cache and Gaussian noise on its logits (CASES.md 3): sometimes
    right, sometimes wrong, so rounds reject at 0, reject mid-block and accept everything."""

    name = "noisy-target"

    def __init__(self, noise: float, seed: int = 0) -> None:
        self.noise, self.seed = noise, seed

    def start(self, target: Transformer, target_cache, batch_size: int, max_len: int, k: int) -> None:
        self.target = target
        self.cache = target.new_cache(batch_size, max_len)
        self.gen = torch.Generator().manual_seed(self.seed)

    def observe(self, tokens, pos, target_out, valid=None, span=None) -> None:
        self.target(tokens, pos, self.cache)  # re-sync this draft's cache on everything the target saw

    def restart_rows(self, rows) -> None:
        """Nothing to forget for rows that all start together (``spire tau``'s batches on the engine); its observe
        writes every row, so it is not fit for requests joining a running batch."""

    def step(self, tokens, pos, span=None):
        logits = self.target(tokens, pos, self.cache).logits[:, -1]
        return logits + self.noise * logits.std() * torch.randn(logits.shape, generator=self.gen)


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """The CLI entry point in-process: (exit code, stdout, stderr)."""
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def spire_rounds(target: Transformer, model, prompts: list[list[int]], new_tokens: int = 24, k: int = 4):
    """Greedy SD of ``prompts`` with a SPIRe draft over ``model`` (prefill 64 positions, the draft's memory fed
    from the prefill): (SD result, the draft's logits of every step concatenated, its ring cache's keys and values
    stacked) — what the fused / panel tests compare across paths."""
    from spire.drafts.spire import SpireDraft
    from tests.oracle import decode, prefill

    draft = SpireDraft(model.requires_grad_(False))  # decoded frozen, as a loaded draft: kept copies, native blocks
    logged = []
    step = draft.step
    draft.step = lambda tokens, pos: logged.append(step(tokens, pos)) or logged[-1]
    state = prefill(target, prompts, 64, hidden_layers=draft.hidden_layers)
    draft.start(target, state.cache, len(prompts), 64, k)
    draft.observe(state.tokens, state.pos, state.out, state.valid)
    res = decode(target, state, new_tokens, draft=draft, k=k)
    return res, torch.cat(logged), torch.stack(draft._cache.k + draft._cache.v)


def mixed_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, omega: float = 0.5) -> LossTerms:
    """draft_logits, target_logits: (..., V). Returns MixedLoss(omega) and its parts (means over positions)."""
    return mixed_loss_logp(draft_logits, F.log_softmax(target_logits.float(), -1), omega)


def with_backend(monkeypatch, *modules, **choices: bool) -> Backend:
    """Run ``modules`` (and every submodule) with a :class:`spire.backend.Backend` of ``choices`` (the rest at
    their defaults) until the test ends; returns it. The tests' way to pick a path (no module switches)."""
    backend = Backend(**choices)
    for module in modules:
        for m in module.modules():
            monkeypatch.setitem(m.__dict__, "backend", backend)
    return backend


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a test server)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


TRAINING_MODULES = ("config", "step", "checkpoint", "ranks", "evaluate", "trainer")
"""The modules of spire.training that the trainer's code is split into (spire.training.distill re-exports them)."""


def set_in_training(name: str, value, monkeypatch=None) -> None:
    """Bind ``name`` to ``value`` in every trainer module (:data:`TRAINING_MODULES`) that binds the same object as
    ``spire.training.distill`` does, and in distill itself: a stand-in (a clock, a poisoned loss) reaches every
    place the trainer uses the name. With ``monkeypatch`` the change is undone after the test."""
    import importlib

    from spire.training import distill

    old = getattr(distill, name)
    mods = [importlib.import_module(f"spire.training.{m}") for m in TRAINING_MODULES]
    targets = [m for m in mods if vars(m).get(name) is old] + [distill]
    assert len(targets) > 1, f"no trainer module uses {name!r}"
    for m in targets:
        if monkeypatch is not None:
            monkeypatch.setattr(m, name, value)
        else:
            setattr(m, name, value)


def scratch_cache(tmp_path):
    """A throwaway SPIRE_CACHE under ``tmp_path`` that reuses the real one's converted model and prepared data
    (symlinked ``models``, ``data``, ``sdist``): what a test trains and measures goes there. Returns its path."""
    import os
    from pathlib import Path

    real = Path(os.environ.get("SPIRE_CACHE") or Path.home() / ".cache" / "spire")
    cache = Path(tmp_path) / "cache"
    cache.mkdir()
    for sub in ("models", "data", "sdist"):
        if (real / sub).exists():
            (cache / sub).symlink_to(real / sub)
    return cache
