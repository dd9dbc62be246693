"""A trained draft kind's module as a newcomer would write it (tests/test_trained_toy_kind.py): "toy", a tiny draft
that `spire train` trains, `spire generate` / `spire tau` decode with, and `spire export` writes out, from this
module and its registry line alone (issue 54, item 1: a trained kind owns its life).

The draft: the target's token embedding (read, not trained), ``depth`` residual MLP blocks of ``width`` hidden
columns, an RMS norm and the target's head: the next token's logits from the current token alone (a learned
bigram over the target's embedding space). Its run folder holds ``toy.safetensors`` (its registry line's
``run_weights``), a spire draft file whose metadata key ``toy_config`` holds :class:`ToyConfig`; its export folder
holds the same file beside a ``config.json``. Its one `spire train` option, ``--toy-width`` (:attr:`ToyConfig.width`),
is declared on its registry line (``train_options``), where the CLI reads it without importing this module.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import nn

from spire.drafts.base import Draft
from spire.errors import CheckpointError, ConfigError
from spire.formats.draft_file import (FORMAT_VERSION, draft_file_kind, fingerprint, read_draft_file, read_draft_meta,
                                      resolve_draft_path, settings_diff, write_draft_file)
from spire.registry import DraftImpl

EXPORT_NAME = "toy.safetensors"
"""The toy's draft file in its run folder and in its export folder."""


@dataclass
class ToyConfig:
    """The toy kind's settings: width (hidden columns of each block), depth (blocks)."""

    width: int = 2
    depth: int = 1

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ToyConfig":
        """Raises ConfigError for a key this toy does not know."""
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"unknown toy settings {unknown}")
        return cls(**d)

    def validate(self, n_target_layers: int | None = None, vocab_size: int | None = None) -> None:
        """Raises ConfigError unless width and depth are >= 1 (the target's shape: unused, the shared signature of
        the draft config classes)."""
        if self.width < 1 or self.depth < 1:
            raise ConfigError(f"--toy-width and the toy's depth must be >= 1, got {self.width} and {self.depth}")


class ToyDraftModel(nn.Module):
    """The toy kind's trainable draft (:class:`spire.drafts.base.TrainableDraft`). Its own weights are the blocks
    (``layers``) and the norm; the embedding and the head are the target's, kept outside its parameters (never
    trained or saved)."""

    kind, default_loss, export_name = "toy", "hard", EXPORT_NAME
    config_class = ToyConfig
    vocab = None  # the target's whole vocabulary

    def __init__(self, target, cfg: ToyConfig) -> None:
        super().__init__()
        cfg.validate()
        d = target.cfg.d_model
        self.cfg = cfg
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, cfg.width, bias=False), nn.SiLU(),
                                                  nn.Linear(cfg.width, d, bias=False)) for _ in range(cfg.depth))
        self.norm = nn.Parameter(torch.ones(d))
        self._target = (target,)  # a tuple: not a submodule (its weights are not the toy's)

    @classmethod
    def for_training(cls, target, cfg, data=None) -> "ToyDraftModel":
        """A fresh toy draft for the TrainConfig ``cfg`` (its ``draft_config``, seeded by ``cfg.seed``): float32, on
        the target's device, trainable; the blocks start near zero (the draft starts as the target's embedding
        read back through its head)."""
        model = cls(target, cfg.draft_config)
        g = torch.Generator().manual_seed(cfg.seed)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        return model.to(target.device).train().requires_grad_(True)

    def target_layers(self) -> tuple[int, ...]:
        return ()

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> float32 logits (B, T, V) of each position's next token."""
        target = self._target[0]
        h = target.model.embed_tokens.weight[tokens].float()
        for block in self.layers:
            h = h + block(h)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        return h @ target.lm_head.weight.float().T

    def train_logits(self, tokens: torch.Tensor, hidden: dict, k: int) -> torch.Tensor:
        """Teacher-forced logits (B, T, V): the same as inference's (each position reads its own token only)."""
        return self.logits(tokens)

    def to_draft_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens

    def save_checkpoint(self, path: Path, target, meta: dict) -> None:
        """Its own weights in a spire draft file, its settings under ``toy_config``."""
        write_draft_file(path, dict(self.state_dict()), {"toy_config": self.cfg.to_dict(),
                                                         "target": fingerprint(target), **meta})

    def load_checkpoint(self, path: Path, target) -> None:
        """The weights of :meth:`save_checkpoint`'s file. Raises CheckpointError for another kind's file, other
        settings or tensors, TokenizerMismatchError for another target's."""
        meta, sd = read_draft_file(path, target)
        if draft_file_kind(meta) != "toy":
            raise CheckpointError(f"draft {path} is not a toy draft")
        if meta["toy_config"] != self.cfg.to_dict():
            raise CheckpointError(f"draft {path} has other toy settings than the run: "
                                  f"{settings_diff(meta['toy_config'], self.cfg.to_dict())}")
        try:
            self.load_state_dict(sd)
        except RuntimeError as e:
            raise CheckpointError(f"draft {path} does not fit a toy draft: {str(e).splitlines()[0]}") from None

    @classmethod
    def load(cls, path: Path, target) -> "ToyDraftModel":
        """The toy draft in the draft file ``path``, with its saved settings, for ``target`` (frozen, eval)."""
        meta = read_draft_meta(path) or {}
        if "toy_config" not in meta:
            raise CheckpointError(f"draft {path} is not a toy draft")
        model = cls(target, ToyConfig.from_dict(meta["toy_config"])).to(target.device)
        model.load_checkpoint(path, target)
        return model.eval().requires_grad_(False)

    def export(self, out_dir: Path, target, meta: dict, target_folder: Path | None = None) -> Path:
        """``toy.safetensors`` in the run folder (the checkpoint's format)."""
        self.save_checkpoint(Path(out_dir) / self.export_name, target, meta)
        return Path(out_dir) / self.export_name

    def as_draft(self) -> "ToyDraft":
        return ToyDraft(self)


class ToyDraft(Draft):
    """The inference draft over a :class:`ToyDraftModel`: each step reads its input token alone (no state)."""

    name = "toy"

    def __init__(self, model: ToyDraftModel) -> None:
        self.model = model

    def start(self, target, target_cache, batch_size, max_len, k) -> None:
        pass

    def restart_rows(self, rows: torch.Tensor) -> None:
        """Nothing is kept per row: a new request in a slot sees nothing of the previous one."""

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, pos: torch.Tensor, span=None) -> torch.Tensor:
        return self.model.logits(tokens)[:, -1]


def load_draft(target, tokenizer=None, path=None, **_) -> ToyDraft:
    """``--draft toy --draft-path PATH``: a toy run folder, its ``toy.safetensors`` or a toy export folder. Raises
    ConfigError (no path) or CheckpointError / TokenizerMismatchError."""
    if not path:
        raise ConfigError("--draft toy needs --draft-path (a `spire train --draft toy` run folder)")
    return ToyDraft(ToyDraftModel.load(resolve_draft_path("toy", path), target))


def _export(src: Path, target, name_or_path: str, k: int):
    """The writer of ``spire export --draft toy``: the draft file ``src`` (checked against ``target``) and a
    ``config.json`` naming it, as a folder that ``--draft toy --draft-path`` reads back."""
    ToyDraftModel.load(src, target)  # refuse another kind's file or another target's before anything is written

    def write(folder: Path) -> None:
        shutil.copy2(src, Path(folder) / EXPORT_NAME)
        (Path(folder) / "config.json").write_text(json.dumps({"spire_format_version": FORMAT_VERSION, "kind": "toy",
                                                              "verifier": name_or_path, "k": k}, indent=2) + "\n")
    return write


KIND = DraftImpl(load=load_draft, model=ToyDraftModel, export=_export)
