"""A small deterministic real-text corpus built from text that ships with every Python install.

Routing statistics recorded on random tokens say nothing about real routing (no specialisation,
no co-activation structure), and the machines have no internet. The docstrings of the standard
library (English prose, code examples) plus the license texts under /usr/share/common-licenses
make a few MB of real text. Sources are read with `ast` (never imported) in sorted order, so the
corpus is identical on every run with the same Python; it is written to a cache dir, not to git.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sys
import sysconfig
from pathlib import Path

LICENSE_DIR = Path("/usr/share/common-licenses")


def default_cache_dir() -> Path:
    return Path(os.environ.get("MOE_CORPUS_CACHE", Path.home() / ".cache" / "moe_trainer"))


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 40:
                out.append(doc)
    return out


def iter_texts(max_bytes: int) -> list[str]:
    """Corpus documents in a fixed order, at most `max_bytes` UTF-8 bytes in total."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in stdlib.rglob("*.py")
        if "site-packages" not in p.parts and "test" not in p.parts and "tests" not in p.parts
    )
    texts: list[str] = []
    total = 0
    sources = [(_docstrings, f) for f in files]
    if LICENSE_DIR.is_dir():
        sources += [
            (lambda p: [p.read_text(errors="replace")], p)
            for p in sorted(LICENSE_DIR.iterdir())
            if p.is_file()
        ]
    for reader, path in sources:
        for doc in reader(path):
            n = len(doc.encode("utf-8")) + len(DOC_SEPARATOR)
            if total + n > max_bytes:
                return texts
            texts.append(doc)
            total += n
    return texts


def build_corpus(max_bytes: int = 4_000_000, cache_dir: str | os.PathLike | None = None) -> Path:
    """Write (once) and return the path of the corpus text file; documents separated by blank lines
    plus a form feed, which the data loader turns into end-of-document tokens."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    key = hashlib.sha256(f"{sys.version}|{max_bytes}|v1".encode()).hexdigest()[:12]
    path = cache / f"corpus-{key}.txt"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    text = DOC_SEPARATOR.join(iter_texts(max_bytes))
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


DOC_SEPARATOR = "\n\n\f"


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Build the real-text corpus and print its path")
    ap.add_argument("--max-bytes", type=int, default=4_000_000)
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args()
    print(build_corpus(args.max_bytes, args.cache_dir))


if __name__ == "__main__":
    main()
