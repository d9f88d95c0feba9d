"""Which digest each fake node's "runtime" reports for an image (``status.containerStatuses[].
imageID``), so that tests can exercise the upgrade gate's digest handling: a re-pushed tag (change
a node's entry), two builds of one tag on two nodes, a digest that fails.

The node agent ignores images (it runs the container's command on this machine); this table is
what it *says* the image was: a reference that pins a digest reports that digest (what a runtime
pulls by digest); a tag reports the digest the node's table maps it to, and nothing (``""``, as
before) when the table has no entry. A container keeps the ID it started with, as a running
container keeps the bits it pulled.
"""

from __future__ import annotations

import re
import threading

_DIGEST = re.compile(r"@(sha256:[0-9a-f]{64})$")


def repository(image: str) -> str:
    """``registry:5000/team/trainer:1.2@sha256:..`` -> ``registry:5000/team/trainer``."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":", 1)[0]


class ImageIds:
    """``{node: {image reference: "sha256:<64 hex>"}}``, changeable while pods run."""

    def __init__(self, table: dict[str, dict[str, str]] | None = None):
        self._lock = threading.Lock()
        self._table = {n: dict(m) for n, m in (table or {}).items()}

    def set(self, node: str, image: str, digest: str | None) -> None:
        """Node ``node`` now holds ``digest`` under ``image`` (None: forget it)."""
        if digest is not None and not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            raise ValueError(f"{digest!r} is not a sha256:<64 hex> digest")
        with self._lock:
            if digest is None:
                self._table.get(node, {}).pop(image, None)
            else:
                self._table.setdefault(node, {})[image] = digest

    def image_id(self, node: str, image: str) -> str:
        pinned = _DIGEST.search(image)
        if pinned:
            return f"{repository(image)}@{pinned.group(1)}"
        with self._lock:
            digest = self._table.get(node, {}).get(image)
        return f"{repository(image)}@{digest}" if digest else ""
