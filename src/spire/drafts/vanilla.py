"""Vanilla speculative decoding (Leviathan et al. 2023; SPIRe paper §4): an independent small model that
shares the target's tokenizer, with its own full KV cache."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from spire.drafts.base import Draft
from spire.formats.draft_file import (DRAFT_KIND_NAMES, EXPORT_KINDS, check_export, draft_file_kind, fingerprint,
                                     other_kind_error, read_draft_file, read_draft_meta, read_export,
                                     resolve_draft_path, settings_diff, warn_if_unfinished, write_draft_file)
from spire.formats.speculators import independent_config
from spire.integrations.vllm_export import INDEPENDENT_FORM
from spire.registry import DraftImpl
from spire.throughput.pricing import shape_of
from spire.errors import CheckpointError, ConfigError, TokenizerMismatchError
from spire.kv_cache import KVCache, Span
from spire.loading import (TOKENIZER_FILES, WEIGHTS_INDEX, check_finite, load_model, load_target, stored_dtype,
                           weight_files)
from spire.model import ForwardOutput, ModelConfig, Transformer
from spire.paths import replace_dir


def check_same_vocabulary(target_tok, draft_tok, target_name: str = "target", draft_name: str = "draft") -> None:
    """Raise TokenizerMismatchError (naming both sides) unless the two tokenizers map tokens to the same ids."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        only_t = len(set(tv.items()) - set(dv.items()))
        raise TokenizerMismatchError(
            f"tokenizers differ: {target_name} has {len(tv)} tokens, {draft_name} has {len(dv)} "
            f"({only_t} token/id pairs of the target are missing or different in the draft)")


class VanillaDraft(Draft):
    """An independent draft model. After each verify it re-reads the k+1 verified positions, so its cache
    holds its own keys/values for every committed token (including a fully accepted block's last token)."""

    name = "vanilla"

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self._cache: KVCache | None = None

    def start(self, target: Transformer, target_cache: KVCache, batch_size: int, max_len: int, k: int) -> None:
        if self.model.cfg.vocab_size != target.cfg.vocab_size:
            raise TokenizerMismatchError(f"draft vocabulary has {self.model.cfg.vocab_size} entries, the "
                                         f"target's has {target.cfg.vocab_size}")
        self._cache = self._full = self.model.new_cache(batch_size, max_len)

    def use_rows(self, n: int) -> bool:
        """Rows [0, n) of its cache (a view)."""
        self._cache = self._full.narrow(n)
        return True

    def restart_rows(self, rows: torch.Tensor) -> None:
        """Nothing to forget: a new request's prefill (:meth:`observe`) and rounds write every position of its row
        before any query reads it (the cache invariant of :mod:`spire.engine.prefill`)."""

    @torch.no_grad()
    def observe(self, tokens: torch.Tensor, pos: torch.Tensor, target_out: ForwardOutput,
                valid: torch.Tensor | None = None, span: Span | None = None) -> None:
        """Run the draft over the tokens (B, T) at positions (B, T). With ``valid`` (B, T), rows without a valid
        token are left untouched (the rows of other requests while one joins a continuous batch)."""
        if valid is not None and not bool(valid.any(1).all()):
            rows = valid.any(1).nonzero()[:, 0]
            sub = self._cache.take_rows(rows)
            self.model(tokens[rows], pos[rows], sub)
            self._cache.put_rows(rows, sub)
            return
        self.model(tokens, pos, self._cache, span=span)

    @torch.no_grad()
    def cost_shape(self, target):
        """Its own model's shape (:func:`spire.throughput.pricing.shape_of`)."""
        return shape_of(self.model)

    def step(self, tokens: torch.Tensor, pos: torch.Tensor, span: Span | None = None) -> torch.Tensor:
        return self.model(tokens, pos, self._cache, span=span).logits[:, -1]


@dataclasses.dataclass
class VanillaConfig:
    """The vanilla draft's training settings (its config class: a TrainConfig's ``draft_config`` for
    ``draft="vanilla"``). n_layers: blocks (None: round(target layers / 8), about 1/8 of the target's body
    parameters)."""

    n_layers: int | None = None

    def resolved_layers(self, n_target_layers: int) -> int:
        """The block count: ``n_layers``, or round(n_target_layers / 8) (at least 1)."""
        return max(1, round(n_target_layers / 8)) if self.n_layers is None else int(self.n_layers)

    def validate(self, n_target_layers: int, vocab_size: int | None = None) -> None:
        """Raise ConfigError unless 1 <= blocks <= the target's layers (``vocab_size``: unused, the shared
        signature of the draft config classes)."""
        n = self.resolved_layers(n_target_layers)
        if not 1 <= n <= n_target_layers:
            raise ConfigError(f"the vanilla draft needs 1 to {n_target_layers} layers (the target's), got {n}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "VanillaConfig":
        """The settings of :meth:`to_dict`'s form (a draft file's ``vanilla_config``). Raises KeyError without
        ``n_layers``."""
        return cls(d["n_layers"])

    def to_state(self) -> int | None:
        """The settings in a run's ``train_state.json`` (its ``vanilla_layers``, the layout of before the draft
        config classes): ``n_layers``."""
        return self.n_layers

    @classmethod
    def from_state(cls, value: int | None) -> "VanillaConfig":
        """The settings of :meth:`to_state`'s form."""
        return cls(value)


def vanilla_config(target: Transformer, n_layers: int | None = None) -> ModelConfig:
    """The vanilla baseline's shape (SPIRe paper §4): the target's width, heads and vocabulary with
    ``n_layers`` blocks (:class:`VanillaConfig`). Raises ConfigError unless 1 <= n_layers <= the target's layers."""
    vc = VanillaConfig(n_layers)
    vc.validate(target.cfg.n_layers)
    return dataclasses.replace(target.cfg.without_layers(vc.resolved_layers(target.cfg.n_layers)),
                               tie_embeddings=True)


class VanillaDraftModel(Transformer):
    """A vanilla draft being trained: a :class:`Transformer` with the training interface
    (:class:`spire.drafts.base.TrainableDraft`). Its checkpoint is a spire draft file of the body (the head is
    tied to the embedding); its export an HF Llama folder (:func:`save_vanilla`)."""

    kind, default_loss, export_name = "vanilla", "hard", "draft"
    config_class = VanillaConfig
    vocab = None  # always the target's whole vocabulary

    @classmethod
    def for_training(cls, target: Transformer, cfg, data=None) -> "VanillaDraftModel":
        """:func:`build_vanilla` with the TrainConfig's ``draft_config`` (:class:`VanillaConfig`) and ``seed``."""
        return build_vanilla(target, cfg.draft_config.n_layers, cfg.seed)

    def target_layers(self) -> tuple[int, ...]:
        return ()

    def train_logits(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], k: int) -> torch.Tensor:
        """One causal pass (a full KV cache: teacher forcing is exact for any k)."""
        B, T = tokens.shape
        pos = torch.arange(T, device=tokens.device)[None].expand_as(tokens)
        return self(tokens, pos, span=Span((0,) * B, T)).logits  # positions 0..T-1 known here: nothing read back

    def to_draft_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens

    def save_checkpoint(self, path: Path, target: Transformer, meta: dict) -> None:
        meta = {"vanilla_config": self.cfg.to_dict(), "target": fingerprint(target), **meta}
        write_draft_file(path, {k: v for k, v in self.state_dict().items() if k != "lm_head.weight"}, meta)

    def load_checkpoint(self, path: Path, target: Transformer) -> None:
        """The weights of :meth:`save_checkpoint`'s file ``path`` (the head is the target's). Raises CheckpointError
        for another kind's file, other settings or tensors (or as :func:`read_draft_file`)."""
        meta, sd = read_draft_file(path, target)
        kind = draft_file_kind(meta)
        if kind not in (None, "vanilla"):  # (None: a file of before the kinds' keys)
            raise CheckpointError(f"draft {path} is {DRAFT_KIND_NAMES[kind]} draft, not vanilla")
        if meta.get("vanilla_config", self.cfg.to_dict()) != self.cfg.to_dict():
            raise CheckpointError(f"draft {path} has other vanilla settings than the run: "
                                  f"{settings_diff(meta['vanilla_config'], self.cfg.to_dict())}")
        loaded = self.load_state_dict(sd, strict=False)
        if loaded.unexpected_keys or set(loaded.missing_keys) - {"lm_head.weight"}:
            raise CheckpointError(f"draft {path} does not fit a vanilla draft of {self.cfg.to_dict()}: unexpected "
                                  f"{loaded.unexpected_keys[:3]}, missing {loaded.missing_keys[:3]}")

    def export(self, out_dir: Path, target: Transformer, meta: dict, target_folder: Path | None = None) -> Path:
        """``draft/``, an HF Llama folder with the target's tokenizer files when ``target_folder`` is given."""
        folder = Path(out_dir) / self.export_name
        save_vanilla(self, folder, target_folder, {"target": fingerprint(target), **meta})
        return folder

    def as_draft(self) -> VanillaDraft:
        return VanillaDraft(self)


def build_vanilla(target: Transformer, n_layers: int | None = None, seed: int = 0) -> VanillaDraftModel:
    """A randomly initialized vanilla draft (normal(0, 0.02) weights, unit norms, tied embeddings), float32,
    on the target's device, trainable."""
    cfg = vanilla_config(target, n_layers)
    g = torch.Generator().manual_seed(seed)
    model = VanillaDraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            else:
                p.fill_(1.0)
    return model.to(target.device).train().requires_grad_(True)


def hf_config(cfg: ModelConfig) -> dict:
    """An HF ``LlamaForCausalLM`` config.json dict for a :class:`ModelConfig` (used when no target folder
    gives one to copy)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.d_head, "intermediate_size": cfg.d_ff,
            "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_eps, "max_position_embeddings": cfg.max_positions,
            "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": cfg.bos_id,
            "eos_token_id": cfg.eos_ids[0] if len(cfg.eos_ids) == 1 else (cfg.eos_ids or None),
            "hidden_act": "silu", "torch_dtype": "float32"}


def save_vanilla(model: Transformer, folder, target_folder, meta: dict) -> None:
    """Write the draft as a Hugging Face Llama folder (config.json from the target's with the draft's
    layer count, model.safetensors, the target's tokenizer files, spire_train.json), replacing ``folder``
    atomically. Loadable by :func:`spire.loading.load_target` and by transformers' AutoModelForCausalLM."""
    target_folder = Path(target_folder) if target_folder is not None else None
    cfg = json.loads((target_folder / "config.json").read_text()) if target_folder else hf_config(model.cfg)
    n = model.cfg.n_layers
    cfg.update(num_hidden_layers=n, tie_word_embeddings=True)
    for key in ("layer_types", "no_rope_layers"):  # per-layer lists: the draft's layers (ModelConfig.without_layers)
        if isinstance(cfg.get(key), list) and cfg[key]:
            cfg[key] = [cfg[key][i % len(cfg[key])] for i in range(n)]
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["torch_dtype"] = "float32"  # the stored tensors' dtype (a bf16 target's config said bfloat16)
    if "dtype" in cfg:
        cfg["dtype"] = "float32"

    sd = {k: v.detach().float().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    check_finite(sd, f"draft {folder} not written")  # weights that could never load are never written

    def write(tmp: Path) -> None:
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / "spire_train.json").write_text(json.dumps(meta, indent=1, default=str))
        for name in TOKENIZER_FILES if target_folder else ():  # the tokenizer's files only: never the target's
            if (target_folder / name).is_file():             # weights, index or other files
                shutil.copy2(target_folder / name, tmp / name)

    replace_dir(folder, write)


def resolve_path(path: str | Path) -> Path:
    """What ``--draft vanilla --draft-path PATH`` names (:func:`spire.formats.draft_file.resolve_draft_path`: an HF
    folder, a .gguf file, or a run folder's ``draft/``). Raises CheckpointError for a missing path, another kind's
    run folder, or a file other than a .gguf (another kind's draft file is named by its kind)."""
    p = resolve_draft_path("vanilla", path)
    if not p.is_dir() and not p.name.endswith(".gguf"):
        kind = draft_file_kind(read_draft_meta(p) or {}) if p.suffix == ".safetensors" else None
        if kind is not None:
            raise other_kind_error(p, "vanilla", kind)
        raise CheckpointError(f"{p} is a file, not a vanilla draft (give an HF folder, a .gguf file or a `spire "
                              "train --draft vanilla` run folder)")
    return p


def load_draft(target: Transformer, path: str | Path | None = None, tokenizer=None, dtype=None, **_) -> VanillaDraft:
    """The vanilla draft at ``path``: a .gguf, an HF folder sharing the target's tokenizer, or a `spire train --draft
    vanilla` run folder. Raises ConfigError (no path), CheckpointError or TokenizerMismatchError."""
    if not path:
        raise ConfigError("--draft vanilla needs --draft-path (a .gguf file or HF folder of a small model "
                          "with the target's tokenizer)")
    path = resolve_path(path)
    if path.is_dir():
        if read_export(path) is not None:  # a `spire export` folder: refuse one exported for another target
            algorithm = check_export(path, target)["speculators_config"].get("algorithm")
            if EXPORT_KINDS.get(algorithm, "vanilla") != "vanilla":
                raise other_kind_error(path, "vanilla", EXPORT_KINDS[algorithm], exported=True)
        elif path.name == "draft":  # a `spire train --draft vanilla` run's draft/
            warn_if_unfinished(path.parent)
    model, draft_tok, _ = load_target(path, dtype=dtype or target.dtype, device=str(target.device))
    if tokenizer is not None:
        check_same_vocabulary(tokenizer, draft_tok, "target", f"draft {path}")
    return VanillaDraft(model)


def _export(src: Path, target: Transformer, name_or_path: str, k: int):
    """The writer of an exported vanilla folder: its HF folder with ``speculators_config`` (algorithm
    "independent") added to its config.json (:func:`spire.export.export_draft`)."""

    src = resolve_path(src)
    if not (src / "config.json").is_file():
        raise CheckpointError(f"{src} is not an HF folder: spire export takes a vanilla draft folder")
    model = load_model(src)
    if model.cfg.vocab_size != target.cfg.vocab_size:
        raise TokenizerMismatchError(f"draft {src} has {model.cfg.vocab_size} vocabulary entries, the target "
                                     f"{target.cfg.vocab_size}")
    config = independent_config(json.loads((src / "config.json").read_text()), target, name_or_path, k)
    weights = weight_files(src)  # what the loader read (an index's files), never a stray file beside them
    config["torch_dtype"] = stored_dtype(weights) or config.get("torch_dtype")  # the stored tensors' dtype
    if "dtype" in config:
        config["dtype"] = config["torch_dtype"]
    keep = [*weights, *(src / n for n in (*TOKENIZER_FILES, "spire_train.json") if (src / n).is_file())]
    if (src / WEIGHTS_INDEX).is_file():
        keep.append(src / WEIGHTS_INDEX)

    def write(tmp: Path) -> None:
        for f in keep:
            shutil.copy2(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return write


KIND = DraftImpl(load=load_draft, model=VanillaDraftModel, export=_export, vllm=INDEPENDENT_FORM)
