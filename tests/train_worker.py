"""A training run on the tiny random target, launched as a separate process by tests/test_trainer.py
(under torchrun for the data-parallel test, or to be killed with SIGKILL for the crash test).

usage: python tests/train_worker.py OUT_DIR DRAFT MAX_STEPS BATCH [CHECKPOINT_EVERY]
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spire.drafts.spire import SpireConfig  # noqa: E402
from spire.training.distill import TrainConfig, init_distributed, train_draft  # noqa: E402
from tests.conftest import make_tiny  # noqa: E402


class RepeatingData:
    """Windows of a fixed random 'language' (same as tests/test_trainer.py)."""

    def __init__(self, vocab=97, n=8, T=32, seed=0):
        self.seqs = torch.randint(0, vocab, (n, T), generator=torch.Generator().manual_seed(seed))

    def sample_train_batch(self, batch_size, seq_len, generator):
        idx = torch.randint(0, len(self.seqs), (batch_size,), generator=generator)
        return self.seqs[idx, :seq_len]


def config(draft: str, max_steps: int, batch: int, checkpoint_every: float = 1e9) -> TrainConfig:
    return TrainConfig(draft=draft, budget_s=1e6, max_steps=max_steps, batch_size=batch, seq_len=32, k=4, lr=3e-3,
                       warmup_steps=2, bf16=False, checkpoint_every=checkpoint_every, vanilla_layers=1,
                       spire=SpireConfig(n_draft_layers=2, window=8))


def main() -> None:
    out, draft, max_steps, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    every = float(sys.argv[5]) if len(sys.argv) > 5 else 1e9
    torch.set_num_threads(1)
    rank, world = init_distributed()
    model, state = train_draft(make_tiny(), RepeatingData(), Path(out), config(draft, max_steps, batch, every),
                               progress=False)
    # every process reports a checksum of its weights, to check that they stayed in sync
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    Path(out, f"rank{rank}.json").write_text(json.dumps({"world": world, "sum": float(flat.double().sum()),
                                                         "abs": float(flat.double().abs().sum())}))
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
