"""The SPIRe draft: Sparse KV cache, Pruned Initialization, Recurrent (feedback) memory.

SPIRe paper §3 (Neelam et al. 2025, arXiv 2504.06419):

1. Sparse attention: a StreamingLLM sink + window mask in training and inference; RoPE uses positions in
   the original text.
2. Pruned initialization: the draft is the target's embedding, a copy of its LAST n_d blocks and its
   unembedding. Draft layer i is initialized from target layer j = n_layers - n_d + i.
3. Feedback memory (Fan et al. 2020) per layer: draft layer i attends, with its own k/v projections (of its
   input norm), over memory vectors m_t^i = sum_l softmax_l(w_il) x_t^l, where x_t^l is the draft's
   activation of token t after draft layer l (l = 0 is the embedding) and w is (n_d, n_d + 1).
4. For the verified past, memory vectors are replaced by the target's activations: layer i uses the
   residual stream entering target layer j. Only drafted positions use the draft's own memory.

The current token always attends to its own key/value (computed from its layer input, as in a normal
block); every earlier position is read as a memory key/value. The embedding and unembedding are shared
with the target and frozen; the blocks, final norm and mixing logits are trained.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from spire.drafts.base import Draft
from spire.errors import CheckpointError, ConfigError, TokenizerMismatchError
from spire.kv_cache import KVCache, RingKVCache, SinkWindow, attention_mask
from spire.model import ForwardOutput, Transformer, rope_cos_sin


@dataclass
class SpireConfig:
    """n_draft_layers: blocks pruned from the target's end (paper: 2 of 8; default here 8 of 30 ≈ 1/4 of
    the body parameters). mix_init: initial softmax logit given to each layer's own input in w, so that at
    initialization a drafted token's memory is close to what the target layer would have read."""

    n_draft_layers: int = 8
    sink: int = 1
    window: int = 64
    mix_init: float = 4.0


def _fingerprint(target: Transformer) -> dict:
    cfg = target.cfg
    emb = target.model.embed_tokens.weight
    return {"vocab_size": cfg.vocab_size, "d_model": cfg.d_model, "n_layers": cfg.n_layers,
            "embedding_checksum": round(float(emb[:64].double().sum()), 3)}


class SpireDraftModel(nn.Module):
    """Trainable SPIRe draft weights, bound to a (frozen) target for its embedding and unembedding.

    Raises ConfigError when n_draft_layers is not in [1, target layers].
    """

    def __init__(self, target: Transformer, cfg: SpireConfig = SpireConfig()) -> None:
        super().__init__()
        n_t = target.cfg.n_layers
        if not 1 <= cfg.n_draft_layers <= n_t:
            raise ConfigError(f"n_draft_layers must be in [1, {n_t}], got {cfg.n_draft_layers}")
        self.cfg = cfg
        self.source_layers = tuple(range(n_t - cfg.n_draft_layers, n_t))  # target layer j of draft layer i
        self.layers = nn.ModuleList(copy.deepcopy(target.layers[j]) for j in self.source_layers)
        self.norm = copy.deepcopy(target.model.norm)
        n = cfg.n_draft_layers
        mix = torch.zeros(n, n + 1)
        mix[torch.arange(n), torch.arange(n)] = cfg.mix_init  # layer i's memory starts near its own input
        self.mix_logits = nn.Parameter(mix)
        self.layers.requires_grad_(True)
        self.norm.requires_grad_(True)
        object.__setattr__(self, "target", target)  # not a submodule: shared, frozen, never saved
        self.view = SinkWindow(cfg.sink, cfg.window)

    # -- pieces shared by inference and training ---------------------------------------------------
    def _rope(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.target.cfg
        return rope_cos_sin(pos, t.d_head, t.rope_theta, dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d_model) -> float32 logits (B, T, V) through the draft norm and the target's unembedding."""
        return self.target.lm_head(self.norm(x)).float()

    def memory(self, xs: list[torch.Tensor]) -> torch.Tensor:
        """Feedback memory. xs: n_d + 1 activations (B, T, d) -> (n_d, B, T, d), m^i = sum_l softmax(w_i)_l x^l."""
        w = self.mix_logits.softmax(-1).to(xs[0].dtype)  # (n_d, n_d + 1), rows sum to 1
        return torch.einsum("il,lbtd->ibtd", w, torch.stack(xs))

    def memory_kv(self, i: int, m: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Layer i's keys/values (B, KV, T, D) of memory vectors m: (B, T, d)."""
        return self.layers[i].memory_kv(m, cos, sin)

    # -- training: the k-pass procedure of the paper's Figure 2 -------------------------------------
    def forward_train(self, tokens: torch.Tensor, target_hidden: dict[int, torch.Tensor], k: int) -> torch.Tensor:
        """Teacher-forced draft logits for every position, as inference would produce them.

        The sequence is cut into blocks of k positions. For the block starting at position s (verified
        prefix = positions < s), pass j = 0..k-1 runs the queries at s + j of every block at once; each
        attends to target memory at positions < s (sink + window), to the draft memory made in passes
        < j of its own block, and to itself.

        Args:
            tokens: (B, T) token ids, T a multiple of k.
            target_hidden: target layer j -> (B, T, d) residual stream entering it, for every source layer.
            k: speculation depth.
        Returns:
            (B, T, V) float32 logits; position t predicts token t + 1.
        """
        B, T = tokens.shape
        if T % k:
            raise ConfigError(f"training sequence length {T} must be a multiple of k={k}")
        dev, dtype = tokens.device, self.target.dtype
        pos = torch.arange(T, device=dev)
        cos_all, sin_all = self._rope(pos[None], dtype)
        # target memory keys/values of every position, per draft layer: (B, KV, T, D)
        kt, vt = zip(*(self.memory_kv(i, target_hidden[j], cos_all, sin_all)
                       for i, j in enumerate(self.source_layers)))
        kd: list[list[torch.Tensor]] = [[] for _ in self.layers]  # draft memory of earlier passes
        vd: list[list[torch.Tensor]] = [[] for _ in self.layers]
        starts = torch.arange(0, T, k, device=dev)  # (T/k,) first position of each block
        out = torch.empty(B, T, self.target.cfg.vocab_size, device=dev)
        blocks = torch.arange(len(starts), device=dev)
        for j in range(k):
            q_pos = starts + j  # (T/k,)
            # target part: keys t < block start, inside the sink + window of the query
            m_target = attention_mask(q_pos[None], pos, self.view)[0, 0] & (pos[None] < starts[:, None])
            # draft part (passes 0..j-1) and self (pass j): same block only, inside the window
            d_pos = torch.cat([starts + jj for jj in range(j + 1)])  # (T/k * (j+1),)
            d_blk = blocks.repeat(j + 1)
            m_draft = (d_blk[None] == blocks[:, None]) & attention_mask(q_pos[None], d_pos, self.view)[0, 0]
            mask = torch.cat([m_target, m_draft], -1)[None, None]  # (1, 1, T/k, T + (j+1) T/k)
            cos, sin = self._rope(q_pos[None], dtype)
            x = self.target.model.embed_tokens(tokens[:, q_pos])  # (B, T/k, d)
            xs = [x]
            for i, layer in enumerate(self.layers):
                def kv_source(k_self, v_self, i=i):
                    return (torch.cat([kt[i], *kd[i], k_self], 2), torch.cat([vt[i], *vd[i], v_self], 2))
                x = layer(x, cos, sin, kv_source, mask)
                xs.append(x)
            out[:, q_pos] = self.logits(x)
            if j < k - 1:
                mem = self.memory(xs)  # (n_d, B, T/k, d)
                for i in range(len(self.layers)):
                    kk, vv = self.memory_kv(i, mem[i], cos, sin)
                    kd[i].append(kk)
                    vd[i].append(vv)
        return out

    # -- persistence ----------------------------------------------------------------------------------
    def save(self, path: Path, extra: dict | None = None) -> None:
        """Write weights (safetensors) and a JSON sidecar atomically to ``path`` (a .safetensors file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"spire_config": asdict(self.cfg), "target": _fingerprint(self.target), **(extra or {})}
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        save_file(state, tmp, metadata={"spire": json.dumps(meta)})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, target: Transformer) -> "SpireDraftModel":
        """Load a draft saved by :meth:`save` for ``target``.

        Raises CheckpointError (missing/unreadable) or TokenizerMismatchError (trained for another target).
        """
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"draft checkpoint not found: {path}")
        try:
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                meta = json.loads(f.metadata()["spire"])
            state = load_file(str(path))
        except Exception as e:
            raise CheckpointError(f"cannot read draft checkpoint {path}: {e}".splitlines()[0]) from None
        fp, want = meta.get("target", {}), _fingerprint(target)
        if fp != want:
            raise TokenizerMismatchError(f"draft {path} was trained for target {fp}, but the target is {want}")
        model = cls(target, SpireConfig(**meta["spire_config"]))
        model.load_state_dict(state)
        return model.to(target.dtype)


class SpireDraft(Draft):
    """Inference wrapper: a :class:`SpireDraftModel` with its own constant-size sink + window KV cache
    (:class:`RingKVCache`, sink + window + k + 1 slots per layer, whatever the context length).

    The draft cache holds, per draft layer and absolute position, the keys/values of the memory vectors:
    projected from target activations for verified positions (:meth:`observe`), from the draft's own
    feedback memory for drafted positions (:meth:`step`).
    """

    name = "spire"

    def __init__(self, model: SpireDraftModel) -> None:
        self.model = model
        self.hidden_layers = model.source_layers
        self._cache: RingKVCache | None = None

    def start(self, target: Transformer, target_cache: KVCache, batch_size: int, max_len: int, k: int) -> None:
        t = target.cfg
        self._cache = RingKVCache(len(self.model.layers), batch_size, t.n_kv_heads, self.model.view, k + 1,
                                  t.d_head, dtype=target.dtype, device=target.device)

    @torch.no_grad()
    def observe(self, tokens: torch.Tensor, pos: torch.Tensor, target_out: ForwardOutput,
                valid: torch.Tensor | None = None) -> None:
        cos, sin = self.model._rope(pos, self.model.target.dtype)
        for i, j in enumerate(self.model.source_layers):
            self._cache.write(i, pos, *self.model.memory_kv(i, target_out.hidden[j], cos, sin), valid=valid)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        m, cache = self.model, self._cache
        x = m.target.model.embed_tokens(tokens)  # (B, 1, d)
        cos, sin = m._rope(pos, x.dtype)
        cache.claim(pos)  # the slots of the new position now hold it (its keys/values follow, per layer)
        mask = attention_mask(pos, cache.key_positions(), m.view)
        xs = [x]
        for i, layer in enumerate(m.layers):
            def kv_source(k_self, v_self, i=i):  # the token's own key/value, then everything up to it
                cache.write(i, pos, k_self, v_self)
                return cache.read(i)
            x = layer(x, cos, sin, kv_source, mask)
            xs.append(x)
        mem = m.memory(xs)  # later tokens read this token as memory, not as its self key/value
        for i in range(len(m.layers)):
            cache.write(i, pos, *m.memory_kv(i, mem[i], cos, sin))
        return m.logits(x)[:, -1]
