"""Split a file (the target's 98 MB GGUF) into parts small enough for one device run's 64 MiB carry, and join
them back there, checked by SHA-256. The two-run procedure is in benchmarks/gpu_bench.sh's header and
docs/bench.md.

    python benchmarks/gguf_parts.py split FILE gpu-carry --parts 2     # here: gpu-carry/part-0, part-1, SHA256
    python benchmarks/gguf_parts.py join gpu-carry OUT.gguf            # there: joined, checked, parts removed
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split(src: Path, folder: Path, parts: int) -> list[Path]:
    """``folder``/part-0 .. part-{parts-1} of ``src`` (equal sizes but the last) and ``folder``/SHA256 (of src)."""
    folder.mkdir(parents=True, exist_ok=True)
    size = src.stat().st_size
    chunk = -(-size // parts)
    out = []
    with open(src, "rb") as f:
        for i in range(parts):
            p = folder / f"part-{i}"
            p.write_bytes(f.read(chunk))
            out.append(p)
    (folder / "SHA256").write_text(f"{sha256(src)} {size} {parts}\n")
    return out


def join(folder: Path, dst: Path) -> Path:
    """Join ``folder``'s parts into ``dst`` (written beside it, renamed when its SHA-256 matches). Exits with one
    error line when a part is missing or the checksum differs."""
    digest, size, parts = (folder / "SHA256").read_text().split()
    missing = [i for i in range(int(parts)) if not (folder / f"part-{i}").is_file()]
    if missing:
        sys.exit(f"error: {folder} lacks part(s) {missing}: send them first (benchmarks/gpu_bench.sh's header)")
    tmp = dst.with_name(dst.name + ".partial")
    with open(tmp, "wb") as out:
        for i in range(int(parts)):
            out.write((folder / f"part-{i}").read_bytes())
    if tmp.stat().st_size != int(size) or sha256(tmp) != digest:
        tmp.unlink()
        sys.exit(f"error: the joined file does not match {folder / 'SHA256'}")
    tmp.replace(dst)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("src", type=Path)
    s.add_argument("folder", type=Path)
    s.add_argument("--parts", type=int, default=2)
    j = sub.add_parser("join")
    j.add_argument("folder", type=Path)
    j.add_argument("dst", type=Path)
    a = ap.parse_args()
    if a.cmd == "split":
        for p in split(a.src, a.folder, a.parts):
            print(f"{p} {p.stat().st_size} bytes")
    else:
        print(f"joined {join(a.folder, a.dst)}")


if __name__ == "__main__":
    main()
