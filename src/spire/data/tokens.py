"""Tokenizing, one job: a tokenizer's fingerprint (sha256 of its serialisation or sorted vocabulary: part of the token
cache's key) and vocabulary size (it picks uint16 or uint32), each document's ids through whichever interface the
tokenizer has (``encode_batch``, a fast tokenizer's backend, or a callable) with the EOS id appended, as int64 arrays,
and :func:`document_separator_id` (the id put between documents). Raises :class:`spire.errors.DataError` for a
tokenizer it cannot fingerprint or a negative id."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from spire.data.sources import Document
from spire.errors import DataError


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's full serialisation (``tokenizers``), else of its sorted vocabulary."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    for obj in (tokenizer, backend):
        if obj is not None and callable(getattr(obj, "to_str", None)):
            try:
                h.update(obj.to_str().encode())
                return h.hexdigest()
            except Exception:  # noqa: BLE001 — fall back to the vocabulary
                pass
    vocab = None
    for obj in (tokenizer, backend):
        if obj is not None and callable(getattr(obj, "get_vocab", None)):
            vocab = obj.get_vocab()
            break
    if vocab is None:
        raise DataError(f"cannot fingerprint tokenizer of type {type(tokenizer).__name__}: "
                        "it has neither to_str() nor get_vocab()")
    h.update(json.dumps(sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])), ensure_ascii=False).encode())
    h.update(type(tokenizer).__name__.encode())
    return h.hexdigest()


def _vocab_size(tokenizer: Any) -> int | None:
    for obj in (tokenizer, getattr(tokenizer, "backend_tokenizer", None)):
        if obj is None:
            continue
        f = getattr(obj, "get_vocab_size", None)
        if callable(f):
            try:
                return int(f(with_added_tokens=True))
            except TypeError:
                return int(f())
    try:
        return int(len(tokenizer))
    except TypeError:
        pass
    v = getattr(tokenizer, "vocab_size", None)
    return int(v) if v is not None else None


def _encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens added."""
    if callable(getattr(tokenizer, "encode_batch", None)):
        return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and callable(getattr(backend, "encode_batch", None)):
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _tokenize_docs(tokenizer: Any, docs: list[Document], eos_id: int | None, progress: bool, desc: str
                   ) -> tuple[list[np.ndarray], int]:
    out: list[np.ndarray] = []
    max_id = -1
    chunk: list[Document] = []
    chunk_chars = 0
    bar = tqdm(total=sum(len(d.text) for d in docs), desc=desc, unit="char", unit_scale=True,
               disable=not progress, leave=False)

    def flush() -> None:
        nonlocal chunk, chunk_chars, max_id
        if not chunk:
            return
        for ids in _encode_texts(tokenizer, [d.text for d in chunk]):
            a = np.asarray(ids + ([eos_id] if eos_id is not None else []), dtype=np.int64)
            if a.size:
                max_id = max(max_id, int(a.max()))
                if int(a.min()) < 0:
                    raise DataError("the tokenizer returned a negative token id")
            out.append(a)
        bar.update(chunk_chars)
        chunk, chunk_chars = [], 0

    try:
        for d in docs:
            chunk.append(d)
            chunk_chars += len(d.text)
            if chunk_chars >= 2_000_000:
                flush()
        flush()
    finally:
        bar.close()
    return out, max_id


def document_separator_id(tokenizer) -> int | None:
    """The id that separates documents in pretraining (``<|endoftext|>`` for SmolLM2), else EOS: the ``eos_id``
    that :func:`prepare_data` and :func:`prepare_text_files` put between documents."""
    for token in ("<|endoftext|>", "</s>", "<eos>"):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            return tid
    return tokenizer.eos_token_id
