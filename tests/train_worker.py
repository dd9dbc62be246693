"""A training run on the tiny random target, launched as a separate process by tests/test_trainer.py
(under torchrun for the data-parallel test, or to kill itself at a chosen point for the crash tests).

usage: python tests/train_worker.py OUT_DIR DRAFT MAX_STEPS BATCH [CHECKPOINT_EVERY [BUDGET_S]]

MAX_STEPS "none" runs until the time budget BUDGET_S is spent. Environment:
  SPIRE_TEST_CLOCK=1        the trainer's clock advances exactly 1 s per reading (a step takes 1 s), so a run
                            limited by time, its learning rates and its log lines are deterministic;
  SPIRE_TEST_CRASH=POINT@N  SIGKILL this process at POINT of the N-th checkpoint write (see ``CRASH_POINTS``).
At exit every process saves its final parameters to OUT_DIR/rank{RANK}.pt.
"""

import io
import os
import signal
import sys
import time as _time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spire.formats import draft_file as spire_drafts  # noqa: E402  (the draft file's writer)
from spire.drafts.spire import SpireConfig  # noqa: E402
from spire.drafts.vanilla import VanillaConfig  # noqa: E402
from spire.training import distill
from tests.helpers import set_in_training  # noqa: E402
from spire.training.distill import TrainConfig, init_distributed, train_draft  # noqa: E402
from tests.conftest import make_tiny  # noqa: E402

# Where a crash can be injected, all inside the N-th checkpoint (checkpoint folder "checkpoint"):
CRASH_POINTS = {
    "draft": "half of checkpoint/draft.safetensors written (in the new temporary folder)",
    "optimizer": "half of checkpoint/optimizer.pt written",
    "state": "half of checkpoint/train_state.json written",
    "swap": "the new folder complete and fsynced, the old one not yet renamed",
    "renames": "between the two renames: the old folder is checkpoint.old, the new one not yet in place",
    "cleanup": "the new folder in place, checkpoint.old not yet removed",
    "export": "half of the exported run-folder draft.safetensors written, after the checkpoint",
    "step": "inside the loss of the step after the N-th checkpoint (between two checkpoints)",
}


class RepeatingData:
    """Windows of a fixed random 'language' (same as tests/test_trainer.py)."""

    def __init__(self, vocab=97, n=8, T=32, seed=0):
        self.seqs = torch.randint(0, vocab, (n, T), generator=torch.Generator().manual_seed(seed))

    def sample_train_batch(self, batch_size, seq_len, generator):
        idx = torch.randint(0, len(self.seqs), (batch_size,), generator=generator)
        return self.seqs[idx, :seq_len]


def config(draft: str, max_steps: int | None, batch: int, checkpoint_every: float = 1e9,
           budget_s: float = 1e6) -> TrainConfig:
    return TrainConfig(draft=draft, budget_s=budget_s, max_steps=max_steps, batch_size=batch, seq_len=32, k=4,
                       lr=3e-3, warmup_steps=2, bf16=False, checkpoint_every=checkpoint_every,
                       draft_config={"spire": SpireConfig(n_draft_layers=2, window=8), "vanilla": VanillaConfig(1)}.get(draft))


class TickClock:
    """Stands in for the ``time`` module in spire.training.distill: every time() reading advances 1 s."""

    def __init__(self):
        self.now = 1000.0

    def time(self) -> float:
        self.now += 1.0
        return self.now

    def __getattr__(self, name):  # anything else (sleep, perf_counter, ...) from the real module
        return getattr(_time, name)


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _die_halfway(path: Path, data: bytes) -> None:
    """Write the first half of ``data`` to ``path`` (as an interrupted write leaves it), then SIGKILL."""
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
    _die()


def install_crash(point: str, nth: int) -> None:
    """Patch the writers that a checkpoint uses so that this process kills itself at ``point`` of the
    ``nth`` checkpoint (counted over this process's checkpoint writes)."""
    assert point in CRASH_POINTS, point
    armed = {"count": 0, "on": False}
    real_replace_dir, real_replace, real_save = distill.replace_dir, os.replace, torch.save
    real_write_text, real_atomic, real_loss = Path.write_text, spire_drafts.atomic_write, distill.mixed_loss_logp

    def replace_dir(path, write):
        if Path(path).name == distill.CHECKPOINT_DIR:
            armed["count"] += 1
            armed["on"] = armed["count"] == nth
        try:
            return real_replace_dir(path, write)
        finally:
            if point != "export":
                armed["on"] = False

    def in_new_checkpoint(path) -> bool:  # a file inside the temporary folder replace_dir fills
        parent = Path(path).parent.name
        return armed["on"] and parent.startswith(f".{distill.CHECKPOINT_DIR}.") and parent.endswith(".tmp")

    def replace(src, dst, *a, **kw):
        src, dst = Path(src), Path(dst)
        if armed["on"] and dst.name == distill.CHECKPOINT_DIR + ".old" and point == "swap":
            _die()
        real_replace(src, dst, *a, **kw)
        if armed["on"] and dst.name == distill.CHECKPOINT_DIR + ".old" and point == "renames":
            _die()
        if armed["on"] and dst.name == distill.CHECKPOINT_DIR and point == "cleanup":
            _die()

    def save(obj, f, *a, **kw):
        if point == "optimizer" and isinstance(f, (str, Path)) and in_new_checkpoint(f):
            buf = io.BytesIO()
            real_save(obj, buf, *a, **kw)
            _die_halfway(Path(f), buf.getvalue())
        return real_save(obj, f, *a, **kw)

    def write_text(self, text, *a, **kw):
        if point == "state" and self.name == distill.STATE_FILE and in_new_checkpoint(self):
            _die_halfway(self, text.encode())
        return real_write_text(self, text, *a, **kw)

    def atomic_write(path, write, text=None):
        path = Path(path)
        if path.name == distill.DRAFT_FILE and ((point == "draft" and in_new_checkpoint(path)) or (
                point == "export" and armed["on"] and path.parent.name != distill.CHECKPOINT_DIR
                and not path.parent.name.endswith(".tmp"))):
            def half(f):  # the real atomic_write's temporary file gets half of the bytes
                buf = io.BytesIO()
                write(buf)
                f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                f.flush()
                os.fsync(f.fileno())
                _die()
            return real_atomic(path, half, text)
        return real_atomic(path, write, text)

    def loss(*a, **kw):
        if point == "step" and armed["count"] == nth:
            _die()
        return real_loss(*a, **kw)

    set_in_training("replace_dir", replace_dir)
    set_in_training("mixed_loss_logp", loss)
    os.replace, torch.save, Path.write_text = replace, save, write_text
    spire_drafts.atomic_write = atomic_write


def main() -> None:
    out, draft, batch = sys.argv[1], sys.argv[2], int(sys.argv[4])
    max_steps = None if sys.argv[3] == "none" else int(sys.argv[3])
    every = float(sys.argv[5]) if len(sys.argv) > 5 else 1e9
    budget = float(sys.argv[6]) if len(sys.argv) > 6 else 1e6
    torch.set_num_threads(1)
    if os.environ.get("SPIRE_TEST_CLOCK"):
        set_in_training("time", TickClock())
    if os.environ.get("SPIRE_TEST_CRASH"):
        point, nth = os.environ["SPIRE_TEST_CRASH"].split("@")
        install_crash(point, int(nth))
    rank, world = init_distributed()
    model, state = train_draft(make_tiny(), RepeatingData(), Path(out),
                               config(draft, max_steps, batch, every, budget), progress=False)
    torch.save({"world": world, "params": {n: p.detach().clone() for n, p in model.named_parameters()}},
               Path(out, f"rank{rank}.pt"))
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
