"""The golden values the gate keeps per smoke plans and hardware (pure).

A passing smoke run reports, per case and compared optimizer step, its loss, gradient norm and
each parameter group's update norm (``SmokeVerdict.golden``). The operator keeps them with the
verdict (key ``golden.json`` of ConfigMap ``moe-gate-<key>``, a ``SmokeGolden`` document), labelled
with the *golden key*: the smoke plans and the GPU model they ran on. The next image tested on
the same plans and hardware gets the newest of them mounted and reports its drift from them,
which the plain-PyTorch comparison of one run cannot show (both sides of it move together with a
new torch).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from moe_contracts.gate import GOLDEN_KIND, GOLDEN_VERSION

from .identity import Identity

GOLDEN_DATA_KEY = "golden.json"  # ConfigMap data key (beside the verdict)
LABEL_GOLDEN_KEY = "moe-operator.io/gate-golden-key"


def golden_key(plans: dict[str, Any], identity: Identity) -> str:
    """The smoke plans and the hardware they ran on: values are comparable only within a key."""
    blob = json.dumps(
        {
            "plans": plans,
            "device": identity.device,
            "gpu": [identity.gpu_model, identity.compute_capability],
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def golden_doc(record: dict[str, Any]) -> dict[str, Any] | None:
    """The SmokeGolden document of a passing GateVerdict that carries golden values."""
    cases = record.get("golden")
    if not record.get("passed") or not cases or not record.get("goldenKey"):
        return None
    ident = record["identity"]
    return {
        "kind": GOLDEN_KIND,
        "version": GOLDEN_VERSION,
        "goldenKey": record["goldenKey"],
        "against": {
            "image": ident.get("image"),
            "digest": record.get("observedDigest") or ident.get("digest"),
            "verifiedAt": record.get("verifiedAt"),
            "versions": {
                k: v
                for k, v in (record.get("versions") or {}).items()
                if k in ("deepspeed", "torch", "transformers", "cuda", "gpu")
            },
        },
        "cases": cases,
    }
