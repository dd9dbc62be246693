"""The draft file: one owner for what every trained draft's .safetensors carries (SPIRe, vanilla, EAGLE-3).

A draft file is a safetensors file whose metadata key ``spire`` holds a JSON object; its ``target`` entry is the
target's :func:`fingerprint`, so a draft trained for another target is refused at load
(:func:`read_draft_file` with ``target``). Writes are atomic (:func:`spire.paths.atomic_write`): an interrupted
write leaves the previous file whole.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from spire import registry
from spire.errors import CheckpointError, ConfigError, TokenizerMismatchError
from spire.loading import check_finite
from spire.model import Transformer
from spire.paths import atomic_write, existing_dir

FORMAT_VERSION = 1
"""Version of an exported draft folder's schema (:mod:`spire.export`); bumped when a field changes meaning."""


def _checksum(rows: torch.Tensor) -> float:
    return round(float(rows.double().sum()), 3)


DIGEST_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtypes a target's weight digest is recorded in: its own, and the roundings of a float32 target (so a draft
trained against it is recognized on the same target loaded in bf16 or fp16, and the reverse)."""


def weights_digest(target: Transformer, dtype: str | None = None) -> str:
    """SHA-256 (hex) of every weight tensor of ``target`` (its parameters in name order: each name, shape and the
    bytes of its values), the values first rounded to ``dtype`` (a name of :data:`DIGEST_DTYPES`; None: as they
    are). Computed once per target and dtype and kept on the target while its weights are unchanged (0.6 s for
    SmolLM2-135M's 135 M parameters on one CPU core)."""
    params = sorted(target.named_parameters(), key=lambda kv: kv[0])
    dt = DIGEST_DTYPES[dtype] if dtype is not None else None
    stamp = tuple((p.data_ptr(), p._version, p.dtype) for _, p in params)
    kept = target.__dict__.setdefault("_spire_weights_digest", {})
    if kept.get(dtype, (None,))[0] == stamp:
        return kept[dtype][1]
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in params:
            t = p.detach() if dt is None else p.detach().to(dt)
            h.update(f"{name}:{tuple(t.shape)}:{str(t.dtype)[6:]};".encode())
            h.update(t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    kept[dtype] = (stamp, h.hexdigest())
    return kept[dtype][1]


def _own_dtype(target: Transformer) -> str | None:
    dtype = next(target.parameters()).dtype
    return next((name for name, dt in DIGEST_DTYPES.items() if dt == dtype), None)


def fingerprint(target: Transformer) -> dict:
    """What a draft records of its target: shape fields; ``weights_sha256``, the digest of every weight tensor's
    content (:func:`weights_digest`) in the target's own dtype and, for a float32 target, rounded to bf16 and to
    fp16; and (read by spire versions before the digest) checksums of the first 64 embedding rows as they are,
    and rounded to bf16 and to fp16."""
    cfg = target.cfg
    rows = target.model.embed_tokens.weight[:64].detach()
    own = _own_dtype(target)
    kinds = list(DIGEST_DTYPES) if own == "float32" else [own] if own else []
    return {"vocab_size": cfg.vocab_size, "d_model": cfg.d_model, "n_layers": cfg.n_layers,
            "weights_sha256": {d: weights_digest(target, None if d == own else d) for d in kinds},
            "embedding_checksum": _checksum(rows), "embedding_checksum_bf16": _checksum(rows.to(torch.bfloat16)),
            "embedding_checksum_fp16": _checksum(rows.to(torch.float16))}


def fingerprint_matches(stored: dict, target: Transformer) -> bool:
    """Whether a draft's stored target fingerprint (:func:`fingerprint`) is ``target``'s, whatever dtype either
    was in: the shape fields exactly, then

    - a fingerprint with ``weights_sha256`` (drafts of this version on): the digest of every weight of ``target``
      equals a stored one of the same dtype, the target's weights rounded to it when the target is wider (a float32
      target against a draft trained on its bf16 copy); a fine-tune of the target that changed any value of any
      weight (its embedding frozen or not) is another target;
    - an older draft's (embedding checksums only): the checksum of the target's first 64 embedding rows as they are
      equal to the stored one, or their bf16 rounding's to the stored bf16 one (a bf16 target, or one rounded by
      use_bf16_weights), or an fp16 target's to the stored fp16 one. A draft written before the bf16 / fp16
      checksums existed: its float32 checksum within 6 standard deviations of what rounding to bf16 can move it
      (6 · 2^-9 · sqrt(Σ e²) / sqrt(3); an independent embedding of the same scale lands inside with a
      probability of about 1 %)."""
    cfg = target.cfg
    want = {"vocab_size": cfg.vocab_size, "d_model": cfg.d_model, "n_layers": cfg.n_layers}
    if any(stored.get(k) != v for k, v in want.items()):
        return False
    digests = stored.get("weights_sha256")
    if isinstance(digests, dict) and digests:
        own = _own_dtype(target)
        if own in digests and digests[own] == weights_digest(target):
            return True
        # a float32 target against a draft trained on its bf16 / fp16 copy, or one whose weights were rounded in
        # place (use_bf16_weights): the target's values rounded to that dtype
        return own == "float32" and any(digests[d] == weights_digest(target, d) for d in ("bfloat16", "float16")
                                        if d in digests)
    rows = target.model.embed_tokens.weight[:64].detach()
    checks = {"embedding_checksum": _checksum(rows), "embedding_checksum_bf16": _checksum(rows.to(torch.bfloat16))}
    if stored.get("embedding_checksum") == checks["embedding_checksum"]:
        return True
    if "embedding_checksum_bf16" in stored:
        return (stored["embedding_checksum_bf16"] == checks["embedding_checksum_bf16"]
                or (rows.dtype == torch.float16
                    and stored.get("embedding_checksum_fp16") == checks["embedding_checksum"]))
    got = stored.get("embedding_checksum")
    tol = 6 * 2.0 ** -9 * float(rows.double().pow(2).sum().sqrt()) / 3 ** 0.5 + 2e-3
    return got is not None and abs(float(got) - checks["embedding_checksum"]) <= tol


def brief(fp: dict) -> dict:
    """A fingerprint for an error message: the shape fields and the digests shortened to 12 hex digits."""
    out = {k: v for k, v in fp.items() if not k.startswith("embedding_checksum")}
    if isinstance(out.get("weights_sha256"), dict):
        out["weights_sha256"] = {d: str(h)[:12] for d, h in out["weights_sha256"].items()}
    return out


def write_draft_file(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Write tensors with spire's JSON metadata (read back by :func:`read_draft_file`) atomically to ``path``.
    Raises CheckpointError, writing nothing, when a tensor holds a NaN or infinite value (it could never load)."""
    check_finite(tensors, f"draft {path} not written")
    data = save({k: v.detach().contiguous() for k, v in tensors.items()}, metadata={"spire": json.dumps(meta)})
    atomic_write(path, lambda f: f.write(data))


DRAFT_KIND_KEYS = registry.KindTable(lambda k: k.config_key)
"""The metadata key that holds each trainable kind's settings in its checkpoint's draft file: a view of the
registry's lines (:attr:`spire.registry.Kind.config_key`)."""


DRAFT_KIND_NAMES = registry.KindTable(lambda k: k.article_name if k.trains else None)
"""Each trainable kind as a message names a draft of it ("a SPIRe draft"): a view of the registry's lines
(:attr:`spire.registry.Kind.article_name`)."""


def draft_file_kind(meta: dict) -> str | None:
    """The trainable kind whose draft file carries ``meta`` (spire metadata), or None."""
    return next((kind for kind, key in DRAFT_KIND_KEYS.items() if key in meta), None)


def read_draft_meta(path: Path) -> dict | None:
    """The spire metadata of the draft file ``path`` without reading its tensors; None when the file has none (not
    written by spire's trainer: an export's weights, say). Raises CheckpointError when it is missing or unreadable."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"draft checkpoint not found: {path}")
    try:
        with safe_open(str(path), "pt") as f:
            meta = (f.metadata() or {}).get("spire")
        return None if meta is None else json.loads(meta)
    except Exception as e:
        if path.suffix != ".safetensors":  # a text file, say: what it is, not the reader's complaint
            raise CheckpointError(f"{path} is a file, not a draft checkpoint (give a `spire train` run folder or the "
                                  "draft .safetensors in it)") from None
        raise CheckpointError(f"cannot read draft checkpoint {path}: {e}".splitlines()[0]) from None


def settings_diff(saved: dict, own: dict) -> str:
    """The settings that differ between a draft file's ``saved`` settings and a run's ``own``, for an error message:
    "window 64 (the run: 32), vocab_size 4096 (the run: unset)"; keys absent on one side read as unset."""
    def show(v):
        return "unset" if v is None else v
    keys = sorted(k for k in set(saved) | set(own) if saved.get(k) != own.get(k))
    return ", ".join(f"{k} {show(saved.get(k))} (the run: {show(own.get(k))})" for k in keys)


def read_draft_file(path: Path, target: Transformer | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(spire metadata, tensors) of a draft .safetensors written by spire. With ``target``, check that the
    draft was trained for it. Raises CheckpointError (missing/unreadable, NaN or infinite weights) or
    TokenizerMismatchError."""
    path = Path(path)
    meta = read_draft_meta(path)
    if meta is None:
        raise CheckpointError(f"{path} is not a spire draft checkpoint (no spire metadata; a vanilla draft's "
                              "weights? use --draft vanilla with its folder)")
    try:
        state = load_file(str(path))
    except Exception as e:
        raise CheckpointError(f"cannot read draft checkpoint {path}: {e}".splitlines()[0]) from None
    check_finite(state, f"draft {path}")
    if target is not None:
        fp = meta.get("target", {})
        if not fingerprint_matches(fp, target):
            raise TokenizerMismatchError(f"draft {path} was trained for target {brief(fp)}, but the target is "
                                         f"{brief(fingerprint(target))}")
    return meta, state


def read_export(folder: str | Path) -> dict | None:
    """The config.json of an exported draft folder, None when ``folder`` is not one (no ``speculators_config``).
    Raises CheckpointError for an unreadable file or a format version this spire does not know."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(config, dict) or "speculators_config" not in config:
        return None
    version = config.get("spire_format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{folder} is an exported draft of format version {version!r}; this spire reads "
                              f"version {FORMAT_VERSION}")
    return config


def check_export(folder: str | Path, target) -> dict:
    """Validate an exported draft folder against ``target``: its verifier fingerprint must be the target's.
    Returns its config. Raises CheckpointError (not an export, unknown version) or TokenizerMismatchError."""
    config = read_export(folder)
    if config is None:
        raise CheckpointError(f"{folder} is not an exported draft (config.json has no speculators_config)")
    verifier = config["speculators_config"].get("verifier", {})
    have = verifier.get("spire_fingerprint")
    if not isinstance(have, dict) or not fingerprint_matches(have, target):
        want = fingerprint(target)
        raise TokenizerMismatchError(f"draft {folder} was exported for verifier {verifier.get('name_or_path')!r} "
                                     f"{brief(have) if isinstance(have, dict) else have}, but the target is "
                                     f"{brief(want)}")
    return config


def run_state(run_dir: Path) -> dict | None:
    """The training state of the run in run_dir (new layout: checkpoint/train_state.json; older runs:
    train_state.json beside the draft), or None for a draft saved by hand."""
    ckpt = existing_dir(run_dir / "checkpoint")
    for state in ([ckpt / "train_state.json"] if ckpt else []) + [run_dir / "train_state.json"]:
        if state.is_file():
            return json.loads(state.read_text())
    return None


def run_finished(run_dir: Path) -> bool:
    """Whether the training run in run_dir finished (a draft without any state was saved by hand and counts as
    finished)."""
    state = run_state(run_dir)
    return state is None or bool(state.get("finished", False))


def warn_if_unfinished(run_dir: Path) -> None:
    """One ``warning:`` line on stderr when run_dir is a training run that has not finished: its draft is an
    intermediate checkpoint (an interrupted or still running `spire train`)."""
    state = run_state(run_dir)
    if state is not None and not state.get("finished", False):
        print(f"warning: {run_dir} is an unfinished training run (stopped at step {state.get('step', '?')}): its "
              f"draft is an intermediate checkpoint; `spire train --resume --out {run_dir}` finishes it",
              file=sys.stderr)


def run_kind(folder: str | Path, *, but: str | None = None) -> registry.Kind | None:
    """The trained kind whose `spire train` run layout ``folder`` holds (its :attr:`spire.registry.Kind.run_weights`
    inside it), the registry's first such kind other than ``but``; None for a folder that holds none, or that is a
    model folder of its own (a ``config.json`` in it: an HF or speculators folder is not a run folder)."""
    p = Path(folder)
    if (p / "config.json").is_file():
        return None
    return next((k for k in registry.KINDS if k.name != but and k.run_weights and (p / k.run_weights).exists()),
                None)


EXPORT_KINDS = {"spire": "spire", "independent": "vanilla", "eagle3": "eagle3"}
"""The draft kind that reads each speculators algorithm spire writes (a `spire export` folder's
``speculators_config.algorithm``; EAGLE-3's also a speculators folder of its own)."""


def other_kind_error(path: str | Path, asked: str, found: str, what: str | None = None,
                     exported: bool = False) -> CheckpointError:
    """The one error for a ``--draft-path`` that holds a draft of another kind than ``--draft asked``, for every
    kind and command: "PATH is a SPIRe draft, not an EAGLE-3 draft: give it as --draft spire --draft-path PATH".
    ``found``: the kind that reads PATH; ``what``: what PATH is when not "a <found> draft" ("an HF model folder");
    ``exported``: PATH is a `spire export` folder of ``found`` ("an exported SPIRe draft")."""
    entry = registry.kind(found)
    what = what or (f"an exported {entry.plain_name} draft" if exported else f"{entry.article_name} draft")
    return CheckpointError(f"{path} is {what}, not {registry.kind(asked).article_name} draft: give it as --draft "
                           f"{found} --draft-path {path}")


def check_draft_kind(path: str | Path, meta: dict, kind: str) -> None:
    """Refuse the draft file ``path`` (its spire metadata ``meta``) unless it holds a ``kind`` draft: another kind's
    is :func:`other_kind_error`; a file without any kind's settings is a CheckpointError naming the missing key."""
    found = draft_file_kind(meta)
    if found == kind:
        return
    if found is not None:
        raise other_kind_error(path, kind, found)
    entry = registry.kind(kind)
    raise CheckpointError(f"{path} is not {entry.article_name} draft checkpoint (no {entry.config_key} in its "
                          "metadata)")


def resolve_draft_path(kind: str, path: str | Path) -> Path:
    """What kind ``kind``'s load is given for the ``--draft-path`` ``path``: the path as given, or the kind's draft
    inside a `spire train` run folder (its registry line's :attr:`~spire.registry.Kind.run_weights`:
    ``draft.safetensors`` for SPIRe, ``draft/`` for vanilla; the run folder itself for a kind that
    ``takes_run_folder``, EAGLE-3). A kind that takes no other folders (SPIRe) also takes a `spire export` folder.

    Raises:
        CheckpointError: nothing at ``path``; a run folder of another trained kind (the message names it and how
            to give it: ``--draft KIND --draft-path PATH``); for a kind that takes no other folders, a folder without
            its draft; an export folder of a format version this spire does not read.
        ConfigError: an unknown kind.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"draft not found: {p}")
    if not p.is_dir():
        return p
    entry = registry.kind(kind)
    if not entry.takes_folders and read_export(p) is not None:  # a `spire export` folder
        return p
    if entry.run_weights and (p / entry.run_weights).exists():
        return p if entry.takes_run_folder else p / entry.run_weights
    other = run_kind(p, but=kind)
    if other is not None:
        mine = f", no {_shown(p, entry.run_weights)}" if entry.run_weights else ""
        raise other_kind_error(p, kind, other.name,
                               f"{other.article_name} draft run (it has {_shown(p, other.run_weights)}{mine})")
    if not entry.takes_folders:
        readers = [k.name for k in registry.KINDS if k.trains and k.takes_folders]
        hf = (p / "config.json").is_file() and readers
        raise CheckpointError(f"{p} holds no {entry.plain_name} draft ({entry.run_weights})"
                              + (f": it is an HF model folder; give it as --draft {' or '.join(readers)} "
                                 f"--draft-path {p}" if hf else ""))
    return p


def _shown(folder: Path, name: str) -> str:
    """A run folder's entry as a message names it: "draft/" for a folder (or a name without a suffix), else the
    name."""
    return f"{name}/" if (folder / name).is_dir() or not Path(name).suffix else name
