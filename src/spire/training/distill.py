"""Train a SPIRe draft by distillation from its target (SPIRe paper §3.5-3.6), for a wall-clock budget.

Each step: the frozen target runs on a batch of training windows (under bf16 autocast when asked) and
returns its logits p and the residual streams entering the draft's source layers; the draft runs the k-pass
procedure (:meth:`SpireDraftModel.forward_train`) and is trained with MixedLoss(omega) by AdamW.

The run is resumable: every ``checkpoint_every`` seconds the draft weights, the optimizer state and a JSON
state (step, tokens seen, elapsed seconds, history) are written atomically to ``out_dir``; calling
:func:`train_spire` again continues from there, and a run that has used its budget returns at once.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from spire.drafts.spire import SpireConfig, SpireDraftModel
from spire.errors import ConfigError
from spire.model import Transformer
from spire.paths import atomic_write
from spire.training.losses import acceptance_alpha, mixed_loss

DRAFT_FILE = "draft.safetensors"
STATE_FILE = "train_state.json"
OPTIM_FILE = "optimizer.pt"


@dataclass
class TrainConfig:
    """budget_s: training wall-clock seconds (excluding evaluation). lr: AdamW peak learning rate, warmup then
    cosine decay to 10% over the budget. omega: MixedLoss weight (1 = pure distillation)."""

    budget_s: float = 1200.0
    max_steps: int | None = None  # also stop after this many optimizer steps (None: only the time budget)
    batch_size: int = 4
    seq_len: int = 256
    k: int = 4
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    omega: float = 0.5
    grad_clip: float = 1.0
    bf16: bool | None = None  # None: on when the device has fast bf16 (CUDA, or a CPU with AMX / AVX512-BF16)
    seed: int = 0
    checkpoint_every: float = 60.0
    spire: SpireConfig = field(default_factory=SpireConfig)

    def validate(self) -> None:
        if self.budget_s <= 0:
            raise ConfigError(f"training budget must be positive, got {self.budget_s} s")
        if self.k < 1 or self.batch_size < 1:
            raise ConfigError("k and batch size must be >= 1")
        if self.seq_len % self.k:
            raise ConfigError(f"seq_len {self.seq_len} must be a multiple of k={self.k}")
        if not 0 <= self.omega <= 1:
            raise ConfigError(f"omega must be in [0, 1], got {self.omega}")


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 autocast speeds up training here (without AMX or AVX512-BF16 it is several times slower)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def _autocast(enabled: bool, device: torch.device):
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def target_pass(target: Transformer, tokens: torch.Tensor, layers: tuple[int, ...], bf16: bool):
    """Frozen target on (B, T) windows -> (logits (B, T, V) float32, {layer: (B, T, d) float32})."""
    pos = torch.arange(tokens.shape[1], device=tokens.device)[None].expand_as(tokens)
    with torch.no_grad(), _autocast(bf16, tokens.device):
        out = target(tokens, pos, hidden_layers=layers)
    return out.logits.float(), {j: h.float() for j, h in out.hidden.items()}


def _lr_at(cfg: TrainConfig, step: int, frac: float) -> float:
    warm = min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    return cfg.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def load_state(out_dir: Path) -> dict | None:
    """The JSON training state of a run folder, or None when no run was saved there."""
    f = Path(out_dir) / STATE_FILE
    return json.loads(f.read_text()) if f.is_file() else None


def train_spire(target: Transformer, data, out_dir: Path, cfg: TrainConfig = TrainConfig(),
                progress: bool = True, log=print) -> tuple[SpireDraftModel, dict]:
    """Train (or resume, or just load when finished) a SPIRe draft in ``out_dir``.

    Args:
        target: frozen target model (float32 weights; bf16 autocast is used when cfg.bf16).
        data: an object with ``sample_train_batch(batch_size, seq_len, generator) -> (B, T) LongTensor``.
        out_dir: run folder (created). Holds draft.safetensors, optimizer.pt, train_state.json.
        cfg: :class:`TrainConfig`.
    Returns:
        (draft model, state dict with "step", "tokens", "elapsed_s", "finished", "history").
    Raises:
        ConfigError: invalid settings, or a saved run in out_dir with different settings.
    """
    cfg.validate()
    if cfg.bf16 is None:
        cfg.bf16 = fast_bf16(target.device)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = target.device
    state = load_state(out_dir)
    cfg_dict = asdict(cfg)
    model = SpireDraftModel(target, cfg.spire)
    if state is not None:
        budget_keys = ("budget_s", "max_steps", "checkpoint_every")
        saved = {k: v for k, v in state["config"].items() if k not in budget_keys}
        now = {k: v for k, v in cfg_dict.items() if k not in budget_keys}
        if saved != now:
            raise ConfigError(f"{out_dir} holds a run with other settings; use another --out or delete it")
        model = SpireDraftModel.load(out_dir / DRAFT_FILE, target)
    else:
        state = {"step": 0, "tokens": 0, "elapsed_s": 0.0, "finished": False, "history": []}
    state["config"] = cfg_dict
    model.train()
    def done() -> bool:
        return state["elapsed_s"] >= cfg.budget_s or (cfg.max_steps is not None and state["step"] >= cfg.max_steps)

    if done():
        state["finished"] = True
        return model.eval(), state

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    if (out_dir / OPTIM_FILE).is_file() and state["step"] > 0:
        opt.load_state_dict(torch.load(out_dir / OPTIM_FILE, weights_only=True))
    gen = torch.Generator().manual_seed(cfg.seed + state["step"])  # resumed runs draw new windows

    def checkpoint() -> None:
        model.save(out_dir / DRAFT_FILE, {"train": {"step": state["step"], "tokens": state["tokens"]}})
        atomic_write(out_dir / OPTIM_FILE, lambda f: torch.save(opt.state_dict(), f))
        atomic_write(out_dir / STATE_FILE, None, json.dumps(state, indent=1))

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=round(cfg.budget_s), initial=round(state["elapsed_s"]), unit="s",
                   desc="train SPIRe draft", dynamic_ncols=True)
    t_last_ckpt = time.time()
    ema_loss = ema_alpha = None
    while not done():
        t0 = time.time()
        tokens = data.sample_train_batch(cfg.batch_size, cfg.seq_len, gen).to(device)
        p_logits, hidden = target_pass(target, tokens, model.source_layers, cfg.bf16)
        for g in opt.param_groups:
            g["lr"] = _lr_at(cfg, state["step"], state["elapsed_s"] / cfg.budget_s)
        with _autocast(cfg.bf16, device):
            q_logits = model.forward_train(tokens, hidden, cfg.k)
        terms = mixed_loss(q_logits, p_logits, cfg.omega)
        opt.zero_grad(set_to_none=True)
        terms.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        dt = time.time() - t0
        state["step"] += 1
        state["tokens"] += tokens.numel()
        state["elapsed_s"] += dt
        ema_loss = terms.loss.item() if ema_loss is None else 0.95 * ema_loss + 0.05 * terms.loss.item()
        ema_alpha = terms.alpha if ema_alpha is None else 0.95 * ema_alpha + 0.05 * terms.alpha
        if state["step"] % 10 == 0 or done():
            state["history"].append({"step": state["step"], "tokens": state["tokens"],
                                     "elapsed_s": round(state["elapsed_s"], 2), "loss": round(ema_loss, 4),
                                     "alpha": round(ema_alpha, 4), "distill": round(terms.distill, 4)})
        if bar is not None:
            bar.update(round(state["elapsed_s"]) - bar.n)
            bar.set_postfix(step=state["step"], alpha=f"{ema_alpha:.3f}", loss=f"{ema_loss:.3f}",
                            tok_s=f"{tokens.numel() / dt:.0f}")
        if time.time() - t_last_ckpt > cfg.checkpoint_every:
            checkpoint()
            t_last_ckpt = time.time()
    state["finished"] = True
    checkpoint()
    if bar is not None:
        bar.close()
    return model.eval(), state


@torch.no_grad()
def evaluate_alpha(model: SpireDraftModel, target: Transformer, windows: torch.Tensor, k: int,
                   bf16: bool = False, batch_size: int = 4) -> list[float]:
    """Expected acceptance alpha = E[sum min(p, q)] per drafted position j = 1..k on held-out windows.

    windows: (N, T) token ids with T a multiple of k. Returns k floats (position 1 = first drafted token).
    """
    model.eval()
    sums = torch.zeros(k)
    count = 0
    for i in range(0, windows.shape[0], batch_size):
        tokens = windows[i: i + batch_size].to(target.device)
        p_logits, hidden = target_pass(target, tokens, model.source_layers, bf16)
        with _autocast(bf16, target.device):
            q_logits = model.forward_train(tokens, hidden, k)
        a = acceptance_alpha(q_logits, p_logits)  # (B, T)
        sums += a.view(a.shape[0], -1, k).sum((0, 1)).cpu()
        count += a.shape[0] * (a.shape[1] // k)
    return (sums / count).tolist()
