"""Which build of a tag-only image a job's gang runs (pure).

A tag can be pushed again, and each node keeps what it pulled. The gate therefore ties verdicts to
the bits that ran, not to the tag:

- once an identity passes, the workers run ``repo@<digest the smoke pod ran>``
  (:func:`worker_image`): no node, no restart of the gang, picks up a re-push mid-run;
- a verdict about a tag is also stored under its digest (:func:`digest_record`), so each digest
  is tested once whatever tag (or digest reference) names it;
- before a launch, the operator resolves the tag on every node of the gang with a short probe pod
  (the digest its runtime reports, what the workers would get under the tag) and
  :func:`resolve` says what follows: the verdict's digest everywhere -> launch; one other digest
  everywhere (the tag was pushed again) -> test that digest first (its verdict when it has one);
  different digests on different nodes -> the condition ``ImageDigestsDiffer``, no smoke test and
  no launch until the nodes agree or the spec pins a digest; no digest reported (a runtime that
  does not say) -> launch as verified;
- when the digest a tag moved to passes, the tag's verdict follows it (:func:`followed_record`);
  when it fails, the tag's pass is revoked (:func:`revoked_record`): later jobs on the tag are
  refused with that failure until it expires, instead of starting the broken bits once more.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .config import GateConfig
from .identity import Identity, digest_of, pinned, repository_of, store_name

PENDING = "pending"  # a probe that has not reported yet
MIXED_RETRY_SECONDS = 30.0  # different builds on the nodes: look again after this long


def worker_image(image: str, verified_digest: str | None) -> str:
    """The image reference the workers run: ``image`` itself when it pins a digest or no digest
    was verified, else ``repo@<verified digest>``."""
    if digest_of(image) or not verified_digest:
        return image
    return f"{repository_of(image)}@{verified_digest}"


@dataclass(frozen=True)
class Resolution:
    """What the gang's nodes hold under a tag. ``kind``: ``pending`` (a probe has not reported),
    ``unknown`` (the runtime reports no digests), ``same`` (the verified digest everywhere),
    ``moved`` (one other digest everywhere: ``digest``), ``mixed`` (different digests)."""

    kind: str
    digest: str | None
    message: str
    by_node: Mapping[str, str | None] = field(default_factory=dict)


def _short(digest: str | None) -> str:
    return digest[:19] if digest else "no digest"


def resolve(image: str, verified: str | None, by_node: Mapping[str, str | None]) -> Resolution:
    """``by_node``: the digest each node's probe reported (``PENDING`` while it runs, None when the
    runtime reported none)."""
    waiting = sorted(n for n, d in by_node.items() if d == PENDING)
    if waiting:
        return Resolution(
            "pending",
            None,
            f"resolving image {image} on node(s) {', '.join(waiting)} (a probe pod reads the "
            "digest each node runs under the tag)",
            by_node,
        )
    seen = {d for d in by_node.values() if d}
    if not seen:
        return Resolution("unknown", verified, f"the runtime reports no digest for {image}")
    where = ", ".join(f"{n} {_short(d)}" for n, d in sorted(by_node.items()))
    if len(seen) > 1 or None in by_node.values():
        return Resolution(
            "mixed",
            None,
            f"the gang's nodes hold different builds of image {image} ({where}): a gang must run "
            f"one build, so it does not launch; pin spec.image to one "
            f"({repository_of(image)}@sha256:...) or have the nodes pull the tag again "
            f"(imagePullPolicy: Always); checked again every {MIXED_RETRY_SECONDS:.0f} s",
            by_node,
        )
    (digest,) = seen
    if digest == verified:
        return Resolution(
            "same", digest, f"every node of the gang runs {_short(digest)} of {image}", by_node
        )
    return Resolution(
        "moved",
        digest,
        f"image {image} now resolves to {digest} on the gang's nodes ({where}); the smoke test "
        f"verified {verified} (the tag was pushed again)",
        by_node,
    )


def _iso(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def digest_record(record: dict[str, Any], identity: Identity) -> dict[str, Any] | None:
    """The verdict ``record`` of tag-only ``identity`` as the verdict of the digest its smoke pod
    ran (None when the runtime reported none): each digest is tested once."""
    digest = record.get("observedDigest")
    if identity.digest or not digest:
        return None
    return dict(record, identity=pinned(identity, digest).to_doc(), attempt=1)


def followed_record(
    tag: Identity, tag_record: dict[str, Any] | None, digest_rec: dict[str, Any]
) -> dict[str, Any]:
    """The tag's verdict after it moved to a digest that passed: that digest's pass, under the
    tag's identity and next attempt."""
    return dict(
        digest_rec,
        identity=tag.to_doc(),
        attempt=int((tag_record or {}).get("attempt", 0)) + 1,
        message=(
            f"the tag moved to {digest_rec.get('observedDigest')}, which passed: "
            f"{digest_rec.get('message')}"
        ),
    )


def revoked_record(
    tag: Identity,
    tag_record: dict[str, Any] | None,
    digest_rec: dict[str, Any],
    now: dt.datetime,
    config: GateConfig,
) -> dict[str, Any]:
    """The tag's verdict after it moved to a digest that failed: a failure (the fail TTL from
    now) that names the digest and its failure; the earlier pass no longer vouches for the tag."""
    digest = digest_rec["identity"].get("digest")
    return dict(
        digest_rec,
        identity=tag.to_doc(),
        attempt=int((tag_record or {}).get("attempt", 0)) + 1,
        passed=False,
        message=(
            f"revoked: image {tag.image} now resolves to {digest}, which failed the smoke test "
            f"({store_name(pinned(tag, digest))}): {digest_rec.get('message')}"
        ),
        revokedPass=(tag_record or {}).get("observedDigest"),
        verifiedAt=_iso(now),
        expiresAt=_iso(now + dt.timedelta(seconds=config.fail_ttl_seconds)),
    )
