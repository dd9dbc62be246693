"""What the scripts of this folder share: a draft file's teacher-forced α on token windows."""
import torch

from spire.drafts.spire import SpireDraftModel
from spire.training.distill import TrainConfig, acceptance_alpha_logp, autocast, fast_bf16, run_target


@torch.no_grad()
def teacher_forced_alpha(path, target, windows: torch.Tensor, k: int = 4, rows: int = 4) -> torch.Tensor:
    """(N, T) Σ min(p, q) of the SPIRe draft file ``path`` on ``windows`` (N, T), as the trainer's held-out α
    (the k-pass procedure, bf16 autocast where bf16 is fast), ``rows`` windows at a time."""
    model = SpireDraftModel.load(path, target).eval()
    bf16 = bool(TrainConfig(k=k, bf16=fast_bf16(torch.device("cpu"))).bf16)
    out = []
    for i in range(0, windows.shape[0], rows):
        tokens = windows[i:i + rows]
        tb = run_target(target, tokens, model.target_layers(), True, bf16)
        with autocast(bf16, target.device):
            q = model.train_logits(tokens, tb.hidden, k)
            logp = tb.target_logp(target, model.vocab)
        out.append(acceptance_alpha_logp(q, logp).float().cpu())
    return torch.cat(out)


def per_position(a: torch.Tensor, k: int = 4) -> list[float]:
    """(N, S) α over whole blocks of k positions -> the mean at drafted positions 1..k, rounded to 3 places."""
    return [round(float(v), 3) for v in a.reshape(a.shape[0], -1, k).mean((0, 1))]
