"""What one verdict vouches for: the gate identity, its key and the names derived from it (pure).

A job may launch only on an identity that passed the smoke test on this cluster: the trainer image
(its digest when the reference pins one), the DeepSpeed version the spec declares, the device kind,
and for GPU verdicts the GPU model, compute capability and CUDA major the kernels depend on.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moe_contracts import env

from .config import GateError

VERDICT_KEY = env.VERDICT_KEY  # ConfigMap data key of the stored verdict
STORE_PREFIX = "moe-gate-"  # ConfigMap moe-gate-<key>
SMOKE_JOB_PREFIX = "moe-smoke-"  # Job moe-smoke-<key>-<attempt>
LABEL_GATE_KEY = "moe-operator.io/gate-key"

_DIGEST_RE = re.compile(r"@(sha256:[0-9a-f]{64})")


def digest_of(reference: str | None) -> str | None:
    """The repository digest `sha256:<64 hex>` of an image reference or a pod's `imageID`
    (`docker-pullable://repo@sha256:...`, `repo@sha256:...`), else None.

    A bare `sha256:...` imageID is not one: it is the image's config ID, which containerd and
    Docker report for an image that has no repository digest (imported or built on the node, never
    pulled), and `repo@<that ID>` names nothing a runtime can resolve; such a runtime counts as
    reporting no digest (the workers run the tag)."""
    m = _DIGEST_RE.search(reference or "")
    return m.group(1) if m else None


def repository_of(image: str) -> str:
    """`registry:5000/team/trainer:1.2@sha256:..` -> `registry:5000/team/trainer`."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name = name[: len(name) - len(last)] + last.split(":", 1)[0]
    return name


@dataclass(frozen=True)
class Identity:
    """What one verdict vouches for."""

    image: str  # the reference as the spec writes it
    digest: str | None  # pinned by the reference (`@sha256:`), else None
    deepspeed_version: str | None  # declared in the spec; None = whatever the image holds
    device: str  # "GPU" | "CPU"
    # GPU verdicts only, from the plan's `hardware` (discovery): what the kernels depend on
    gpu_model: str | None = None  # "NVIDIA H200"
    compute_capability: str | None = None  # "9.0"
    cuda_major: str | None = None  # major of the driver's CUDA version: "12"

    @property
    def subject(self) -> str:
        """What the key hashes: a pinned digest stands for the image whatever tag is written."""
        return f"{repository_of(self.image)}@{self.digest}" if self.digest else self.image

    @property
    def key(self) -> str:
        fields: dict[str, str | list[str]] = {
            "image": self.subject,
            "deepspeed": self.deepspeed_version or "",
            "device": self.device,
        }
        if self.device == "GPU":
            fields["gpu"] = [
                self.gpu_model or "",
                self.compute_capability or "",
                self.cuda_major or "",
            ]
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def describe(self) -> str:
        ds = (
            f"deepspeed {self.deepspeed_version}"
            if self.deepspeed_version
            else "deepspeed (undeclared)"
        )
        return f"image {self.image}, {ds}, {self.device}{self.hardware()}"

    def hardware(self) -> str:
        if self.device != "GPU" or not (
            self.gpu_model or self.compute_capability or self.cuda_major
        ):
            return ""
        parts = [
            p
            for p in (
                self.compute_capability and f"compute capability {self.compute_capability}",
                self.cuda_major and f"CUDA {self.cuda_major}",
            )
            if p
        ]
        return f" {self.gpu_model or 'unknown GPU'}" + (f" ({', '.join(parts)})" if parts else "")

    def to_doc(self) -> dict[str, Any]:
        doc = {
            "image": self.image,
            "digest": self.digest,
            "deepspeedVersion": self.deepspeed_version,
            "device": self.device,
            "key": self.key,
        }
        if self.device == "GPU":
            doc.update(
                gpuModel=self.gpu_model,
                computeCapability=self.compute_capability,
                cudaMajor=self.cuda_major,
            )
        return doc


def identity_for(
    image: str,
    deepspeed_version: str | None,
    device: str,
    hardware: Mapping[str, Any] | None = None,
) -> Identity:
    """``hardware``: the plan's `hardware` block (`gpu`, `computeCapability`, `cudaDriverVersion`),
    which GPU verdicts are keyed by; ignored for CPU."""
    if device not in ("GPU", "CPU"):
        raise GateError(f"device: {device!r} is not GPU or CPU")
    if not image:
        raise GateError("image: empty image reference")
    hw = dict(hardware or {}) if device == "GPU" else {}
    cuda = str(hw.get("cudaDriverVersion") or "").split(".")[0] or None
    return Identity(
        image=image,
        digest=digest_of(image),
        deepspeed_version=deepspeed_version,
        device=device,
        gpu_model=hw.get("gpu") or None,
        compute_capability=hw.get("computeCapability") or None,
        cuda_major=cuda,
    )


def pinned(identity: Identity, digest: str) -> Identity:
    """The identity of the bits a pod actually ran: the image pinned to ``digest``."""
    return Identity(
        image=f"{repository_of(identity.image)}@{digest}",
        digest=digest,
        deepspeed_version=identity.deepspeed_version,
        device=identity.device,
        gpu_model=identity.gpu_model,
        compute_capability=identity.compute_capability,
        cuda_major=identity.cuda_major,
    )


def store_name(identity: Identity) -> str:
    return f"{STORE_PREFIX}{identity.key}"


def smoke_job_name(identity: Identity, attempt: int) -> str:
    """Deterministic: every job that needs this identity verified names the same Job."""
    return f"{SMOKE_JOB_PREFIX}{identity.key}-{attempt}"
