"""What goes into an image: the Dockerfiles' build context, its content key, their pins.
Test and dev infrastructure (``moe_localkube.images`` builds the images from it)."""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
from pathlib import Path

from . import binaries

REPO_ROOT = binaries.REPO_ROOT
DOCKERFILES = {
    "operator": REPO_ROOT / "Dockerfile",
    "trainer": REPO_ROOT / "trainer_image" / "Dockerfile",
}
SKIP_PARTS = {"__pycache__", ".pytest_cache"}


def debian_mirror() -> str:
    """The Debian mirror apt uses on this host (deb822 or one-line sources), else deb.debian.org."""
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        m = re.search(r"^URIs:\s*(\S+)", path.read_text(), re.MULTILINE)
        if m and "security" not in m.group(1):
            return m.group(1)
    try:
        m = re.search(
            r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+\S+",
            Path("/etc/apt/sources.list").read_text(),
            re.MULTILINE,
        )
        if m:
            return m.group(1)
    except OSError:
        pass
    return "http://deb.debian.org/debian"


def sha(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()


def _files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    out = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_PARTS and not d.endswith(".egg-info"))
        out += [Path(root) / f for f in sorted(files) if not f.endswith(".pyc")]
    return out


def copied_sources(dockerfile: Path) -> list[str]:
    """The build-context paths a Dockerfile COPYs or ADDs (``--from=`` copies excluded)."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        words = line.split()
        if (
            len(words) >= 3
            and words[0].upper() in ("COPY", "ADD")
            and not any(w.startswith("--from=") for w in words)
        ):
            out += [w for w in words[1:-1] if not w.startswith("--")]
    return out


def dockerfile_pins() -> list[str]:
    """``name==version`` arguments of the Dockerfiles' ``pip install`` commands."""
    out = []
    for path in DOCKERFILES.values():
        for cmd in re.findall(r"pip install([^&]*)", re.sub(r"\\\n", " ", path.read_text())):
            out += [
                w.strip('"') for w in cmd.split() if re.fullmatch(r'"?[A-Za-z0-9_.-]+==[^ "]+"?', w)
            ]
    return sorted(set(out))


def dockerignore(context: Path = REPO_ROOT) -> list[str]:
    try:
        lines = (context / ".dockerignore").read_text().splitlines()
    except OSError:
        return []
    return [ln.strip().rstrip("/") for ln in lines if ln.strip() and not ln.startswith(("#", "!"))]


def _ignored(rel: str, patterns: list[str]) -> bool:
    """The subset of .dockerignore matching used here: a pattern matches the path or a parent."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(
        fnmatch.fnmatch(p, pat)
        or fnmatch.fnmatch(p, pat.removeprefix("**/"))
        or (fnmatch.fnmatch(parts[i - 1], pat.removeprefix("**/")) and pat.startswith("**/"))
        for pat in patterns
        for i, p in enumerate(prefixes, 1)
    )


def context_digest(dockerfile: Path, context: Path = REPO_ROOT) -> str:
    """Hash of the Dockerfile and every file it copies from ``context`` (names and contents),
    without what ``.dockerignore`` keeps out of the build context."""
    ignore = dockerignore(context)
    parts: list[bytes | str] = [dockerfile.read_bytes(), "\n".join(ignore)]
    for src in copied_sources(dockerfile):
        for f in _files_under(context / src):
            rel = str(f.relative_to(context))
            if not _ignored(rel, ignore):
                parts += [rel, f.read_bytes()]
    return sha(*parts)
