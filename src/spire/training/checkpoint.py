"""Reading a run folder back for a resume: the JSON state of its last complete checkpoint, its append-only log
(torn lines dropped), and the checks that a resume continues the same run (:data:`RESUME_SETTINGS` may change,
nothing else) and that a new run does not overwrite a saved one. The trainer writes checkpoints
(:meth:`spire.training.trainer.Trainer.checkpoint`).
"""

from __future__ import annotations

import json
from pathlib import Path

from spire.errors import CheckpointError, ConfigError
from spire.paths import existing_dir
from spire.training.config import CHECKPOINT_DIR, STATE_FILE, TrainConfig


def load_state(out_dir: Path) -> dict | None:
    """The JSON training state of a run folder's last complete checkpoint, or None when there is none."""
    ckpt = existing_dir(Path(out_dir) / CHECKPOINT_DIR)
    if ckpt is None or not (ckpt / STATE_FILE).is_file():
        return None
    try:
        return json.loads((ckpt / STATE_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {ckpt / STATE_FILE} (damaged: {e}); resume from a copy of the run or "
                              "train into another --out") from e


def read_log(path: Path) -> tuple[list[dict], int]:
    """The entries of an append-only JSON-lines log and how many lines were dropped: a line that is not a whole
    JSON object (torn by a crash or a full disk while it was appended) is dropped, with everything after it."""
    rows: list[dict] = []
    lines = Path(path).read_text(errors="replace").splitlines()
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            row = json.loads(ln)
        except ValueError:
            row = None
        if not isinstance(row, dict):
            return rows, sum(1 for x in lines[i:] if x.strip())
        rows.append(row)
    return rows, 0


def refuse_existing_run(out_dir: Path, state: dict | None) -> None:
    """Raise ConfigError when ``state`` (:func:`load_state` of ``out_dir``) is a saved run: a new run may not
    overwrite it."""
    if state is not None:
        raise ConfigError(f"{out_dir} already holds a run (step {state['step']}); pass --resume to continue it "
                          "or choose another --out")


RESUME_SETTINGS = ("budget_s", "max_steps", "checkpoint_every", "eval_every", "compile")
"""TrainConfig fields a resumed run may take anew: its limits, and how a step runs (compile), not what it computes.
Every other field must equal the saved run's."""


def _check_saved_config(out_dir: Path, state: dict, cfg_dict: dict) -> None:
    """Raise ConfigError when the run saved in out_dir has other settings than ``cfg_dict`` (those of
    :data:`RESUME_SETTINGS` may change; a field added since the run was saved reads as its default)."""
    defaults = json.loads(json.dumps(TrainConfig(draft=state["config"].get("draft", "spire")).to_dict()))
    merged = {k: {**defaults[k], **v} if isinstance(v, dict) and isinstance(defaults.get(k), dict) else v
              for k, v in state["config"].items()}  # a field added to a draft's config since reads as its default
    saved = {k: v for k, v in {**defaults, **merged}.items() if k not in RESUME_SETTINGS}
    now = {k: v for k, v in cfg_dict.items() if k not in RESUME_SETTINGS}
    if saved != now:
        diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        raise ConfigError(f"{out_dir} holds a run with other settings ({', '.join(diff)}); use another --out "
                          "or delete it")
