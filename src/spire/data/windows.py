"""Token windows, one job: the prepared token data in memory (:class:`TokenSplit`, one split's documents as one flat
uint16/uint32 token array with int64 document offsets; :class:`TokenData`, the training and held-out splits with their
manifest and per-source summary) and the windows drawn from it: ``(batch, seq_len)`` int64 training windows inside one
document each (:meth:`TokenData.sample_train_batch`) and non-overlapping ``(n, L + G)`` int64 held-out contexts
spread over documents and sources (:meth:`TokenData.heldout_contexts`). Raises :class:`spire.errors.DataError` when
too few windows exist."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from spire.data.sources import SOURCES, _canonical_sources
from spire.errors import DataError


@dataclass(eq=False)
class TokenSplit:
    """The documents of one split as one flat token array.

    ``tokens``: 1-D uint16/uint32 token ids of every document back to back (each ending with the EOS id when one
    is used); ``offsets``: int64 of length ``n_docs + 1``, document ``i`` is ``tokens[offsets[i]:offsets[i+1]]``;
    ``names`` / ``sources``: per document."""

    tokens: np.ndarray
    offsets: np.ndarray
    names: list[str]
    sources: list[str]

    def __len__(self) -> int:
        return len(self.names)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per document (int64, EOS included)."""
        return np.diff(self.offsets)

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]: self.offsets[i + 1]]

    def index(self, source: str, name: str) -> int:
        for i, (s, n) in enumerate(zip(self.sources, self.names)):
            if s == source and n == name:
                return i
        raise KeyError(f"{source}/{name}")


def _check_positive(**kw: int) -> None:
    for k, v in kw.items():
        if int(v) < 1:
            raise DataError(f"{k} must be ≥ 1 (got {v})")


@dataclass(eq=False)
class TokenData:
    """Prepared token data: a training and a held-out :class:`TokenSplit`, plus its manifest."""

    train: TokenSplit
    heldout: TokenSplit
    manifest: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    _starts_cache: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)

    @property
    def eos_id(self) -> int | None:
        return self.manifest.get("eos_id")

    # -- summary
    def summary(self) -> dict[str, Any]:
        """``{"train": {"documents", "tokens"}, "heldout": {...}, "sources": {source: {"train_documents",
        "train_tokens", "heldout_documents", "heldout_tokens", "heldout_max_doc_tokens"}}, "vocab_size",
        "eos_id", "key", "path"}`` (tokens include one EOS per document)."""
        per: dict[str, dict[str, int]] = {}
        for split_name, split in (("train", self.train), ("heldout", self.heldout)):
            lens = split.lengths
            for src, n in zip(split.sources, lens):
                e = per.setdefault(src, {"train_documents": 0, "train_tokens": 0, "heldout_documents": 0,
                                         "heldout_tokens": 0, "heldout_max_doc_tokens": 0})
                e[f"{split_name}_documents"] += 1
                e[f"{split_name}_tokens"] += int(n)
                if split_name == "heldout":
                    e["heldout_max_doc_tokens"] = max(e["heldout_max_doc_tokens"], int(n))
        order = [s for s in SOURCES if s in per] + [s for s in per if s not in SOURCES]
        return {
            "train": {"documents": len(self.train), "tokens": self.train.n_tokens},
            "heldout": {"documents": len(self.heldout), "tokens": self.heldout.n_tokens},
            "sources": {s: per[s] for s in order},
            "vocab_size": self.manifest.get("vocab_size"),
            "eos_id": self.eos_id,
            "key": self.manifest.get("key"),
            "path": str(self.path) if self.path else None,
        }

    # -- training windows
    def _train_starts(self, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        if seq_len not in self._starts_cache:
            lens = self.train.lengths
            ok = np.nonzero(lens >= seq_len)[0]
            counts = lens[ok] - seq_len + 1  # valid window starts per eligible document
            self._starts_cache[seq_len] = (ok, np.cumsum(counts))
        return self._starts_cache[seq_len]

    def sample_train_batch(self, batch_size: int, seq_len: int, generator: torch.Generator | None = None
                           ) -> torch.Tensor:
        """``(batch_size, seq_len)`` int64 token windows, each inside one training document.

        Windows are uniform over every valid start position of every training document at least ``seq_len``
        tokens long (so documents are weighted by their number of windows, ~ their length). Reproducible for a
        seeded ``generator``. Raises :class:`DataError` if no training document is ``seq_len`` tokens long."""
        _check_positive(batch_size=batch_size, seq_len=seq_len)
        ok, cum = self._train_starts(int(seq_len))
        if len(ok) == 0:
            longest = int(self.train.lengths.max()) if len(self.train) else 0
            raise DataError(f"no training document has {seq_len} tokens (longest: {longest}); lower seq_len")
        u = torch.randint(0, int(cum[-1]), (int(batch_size),), generator=generator).numpy()
        j = np.searchsorted(cum, u, side="right")
        within = u - np.concatenate(([0], cum))[j]
        starts = self.train.offsets[ok[j]] + within
        idx = starts[:, None] + np.arange(int(seq_len))[None, :]
        return torch.from_numpy(self.train.tokens[idx].astype(np.int64))

    # -- held-out windows
    def heldout_windows(self, L: int, G: int, n: int, seed: int = 0, sources: Sequence[str] | None = None
                        ) -> list[tuple[int, int]]:
        """``n`` ``(document index in self.heldout, start within the document)`` pairs: see
        :meth:`heldout_contexts`."""
        _check_positive(L=L, n=n)
        if int(G) < 0:
            raise DataError(f"G must be ≥ 0 (got {G})")
        W = int(L) + int(G)
        if sources is not None:
            sources = _canonical_sources(sources)
        eos = self.eos_id
        rng = np.random.default_rng(int(seed))
        per_source: dict[str, list[list[tuple[int, int]]]] = {}
        longest = 0
        for i in range(len(self.heldout)):
            src = self.heldout.sources[i]
            length = int(self.heldout.lengths[i]) - (1 if eos is not None else 0)  # never include our EOS
            longest = max(longest, length)
            if (sources is not None and src not in sources) or length < W:
                continue
            k = length // W
            offset = int(rng.integers(0, length - k * W + 1))
            starts = offset + W * rng.permutation(k)
            per_source.setdefault(src, []).append([(i, int(s)) for s in starts])
        # Document order: shuffled within each source, then interleaved across sources (in SOURCES order).
        docs: list[list[tuple[int, int]]] = []
        shuffled = {s: [lst[j] for j in rng.permutation(len(lst))] for s, lst in per_source.items()}
        depth = max((len(v) for v in shuffled.values()), default=0)
        for r in range(depth):
            for s in sorted(shuffled, key=lambda s: SOURCES.index(s) if s in SOURCES else len(SOURCES)):
                if r < len(shuffled[s]):
                    docs.append(shuffled[s][r])
        out: list[tuple[int, int]] = []
        r = 0
        while len(out) < n and any(r < len(d) for d in docs):
            for d in docs:
                if r < len(d):
                    out.append(d[r])
                    if len(out) == n:
                        break
            r += 1
        if len(out) < n:
            where = f" from {', '.join(sources)}" if sources is not None else ""
            raise DataError(
                f"only {len(out)} non-overlapping held-out windows of L+G = {W} tokens exist{where} "
                f"(in {len(docs)} held-out documents that long; longest held-out document: {longest} tokens), "
                f"{n} asked: lower n or L")
        return out

    def heldout_contexts(self, L: int, G: int, n: int, seed: int = 0, sources: Sequence[str] | None = None
                         ) -> torch.Tensor:
        """``(n, L + G)`` int64 token windows from held-out documents: ``[:, :L]`` is a context, ``[:, L:]`` the
        text that follows it.

        Windows lie inside one held-out document each (never including the EOS appended after it), do not
        overlap within a document, and are spread round-robin over the documents long enough (documents in a
        seeded shuffle, interleaved across sources). Deterministic for ``seed``; the windows for ``n`` are the
        first ``n`` of those for any larger ``n``. ``sources`` restricts to some sources. Raises
        :class:`DataError` if fewer than ``n`` such windows exist."""
        wins = self.heldout_windows(L, G, n, seed, sources)
        W = int(L) + int(G)
        starts = np.array([self.heldout.offsets[i] + s for i, s in wins], dtype=np.int64)
        idx = starts[:, None] + np.arange(W)[None, :]
        return torch.from_numpy(self.heldout.tokens[idx].astype(np.int64))
