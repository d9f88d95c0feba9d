"""What the gate says: condition messages for verdicts, failures and skips (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .identity import Identity, store_name

# Condition reasons of UpgradeVerified (besides GateSkipped / GateNotConfigured in constants.py)
R_SMOKE_TEST_RUNNING = "SmokeTestRunning"
R_SMOKE_TEST_PASSED = "SmokeTestPassed"
R_SMOKE_TEST_FAILED = "SmokeTestFailed"
R_CACHED_VERDICT = "CachedVerdict"
R_IMAGE_DIGEST_CHANGED = "ImageDigestChanged"  # a tag-only image's pods run other bits
R_IMAGE_DIGESTS_DIFFER = "ImageDigestsDiffer"  # the gang's nodes hold different builds of a tag


def failure_text(doc: dict[str, Any]) -> str:
    """`check 'numerics' of case 'mixtral' failed: <message>; exception: <last line>`."""
    check, case = doc.get("failedCheck"), doc.get("failedCase")
    msg = doc.get("message") or next(
        (
            c["message"]
            for c in doc.get("checks") or ()
            if c.get("name") == check and c.get("case") == case
        ),
        "",
    )
    where = f"check '{check}'" + (f" of case '{case}'" if case else "")
    head = f"{where} failed: {msg}" if check else f"smoke test failed: {msg}"
    exc = (doc.get("exception") or "").strip().splitlines()
    if exc and exc[-1] not in msg:
        head += f"; exception: {exc[-1][:300]}"
    return head


def hardware_mismatch(identity: Identity, versions: Mapping[str, Any]) -> str | None:
    """Why a GPU verdict does not vouch for ``identity``'s GPU (None: it does)."""
    ran = {
        "GPU model": versions.get("gpu"),
        "compute capability": versions.get("computeCapability"),
        "CUDA major": str(versions.get("cudaDriver") or "").split(".")[0] or None,
    }
    want = {
        "GPU model": identity.gpu_model,
        "compute capability": identity.compute_capability,
        "CUDA major": identity.cuda_major,
    }
    bad = [
        f"{k} {ran[k] or 'unknown'} (identity: {want[k]})"
        for k in want
        if want[k] and ran[k] != want[k] and (ran[k] is not None or k != "CUDA major")
    ]
    return f"the smoke test ran on other hardware: {', '.join(bad)}" if bad else None


def from_record(
    rec: dict[str, Any], identity: Identity, *, fresh: bool, namespace: str
) -> tuple[str, str, str]:
    vs = rec.get("versions") or {}
    stack = ", ".join(
        f"{k} {vs[k]}" for k in ("deepspeed", "torch", "transformers", "cuda") if vs.get(k)
    )
    where = f"smoke Job {rec.get('smokeJob')} at {rec['verifiedAt']}"
    if rec["passed"]:
        reason = R_SMOKE_TEST_PASSED if fresh else R_CACHED_VERDICT
        digest = f" (digest {rec['observedDigest']})" if rec.get("observedDigest") else ""
        return (
            "True",
            reason,
            (
                f"{identity.describe()}{digest} passed the smoke test ({stack}; {where}; "
                f"valid until {rec['expiresAt']})"
            ),
        )
    return (
        "False",
        R_SMOKE_TEST_FAILED,
        (
            f"{identity.describe()}: {failure_text(rec)} ({where}"
            f"{'; cached' if not fresh else ''}; tested again after "
            f"{rec['expiresAt']}, or now after `kubectl -n {namespace} delete job "
            f"{rec.get('smokeJob')} configmap {store_name(identity)}`)"
            # a revoked tag says so on every pass, as the pass that revoked it did
            f"{f'; the cached pass of {identity.image} is revoked' if 'revokedPass' in rec else ''}"
        ),
    )


def skip_audit(body: dict[str, Any]) -> str:
    """Who set `spec.gate.skip` and when, from managedFields (the API server records the field
    manager of every field); '' when unknown."""
    found = []
    for entry in (body.get("metadata") or {}).get("managedFields") or ():
        fields = entry.get("fieldsV1") or {}
        if "f:skip" in ((fields.get("f:spec") or {}).get("f:gate") or {}):
            found.append(entry)
    if not found:
        return ""
    e = max(found, key=lambda x: x.get("time") or "")
    return (
        f"set by {e.get('manager', 'unknown')} ({e.get('operation', '?')}) at {e.get('time', '?')}"
    )


def skip_message(identity: Identity, reason: str, audit: str) -> str:
    return f"upgrade gate skipped for {identity.describe()}: {reason}" + (
        f" ({audit})" if audit else ""
    )
