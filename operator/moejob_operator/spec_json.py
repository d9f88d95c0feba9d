"""The JSON-text forms of the spec's typed free-form fields (``hfConfigJSON``,
``deepspeedOverridesJSON``) and the depth bound on both forms.

The CRD types ``hfConfig`` and ``deepspeedOverrides`` key by key (``moe_localkube.crdgen``
generates the schemas from transformers and DeepSpeed), so the API server never walks a free-form
subtree, whose cost grows about twice per level of nesting. Values a structural schema cannot
type travel as JSON text, which the API server stores without walking it; they are parsed here
under a length and depth bound and merged over the object form.
"""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 8
HF_CONFIG_JSON_BYTES = 262_144
DEEPSPEED_OVERRIDES_JSON_BYTES = 65_536


def _json_object(text: Any, field: str, limit: int) -> dict[str, Any]:
    """``text`` (a JSON object, at most ``limit`` characters and MAX_JSON_DEPTH levels deep)."""
    if not isinstance(text, str):
        raise ValueError(f"{field}: a {type(text).__name__}, must be a string of JSON text")
    if len(text) > limit:
        raise ValueError(f"{field}: {len(text)} characters, at most {limit}")
    try:
        obj = json.loads(text)
    except RecursionError:
        raise ValueError(f"{field}: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:
        raise ValueError(f"{field}: not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{field}: must be a JSON object, got {type(obj).__name__}")
    _check_depth(obj, field)
    return obj


def _check_depth(obj: Any, field: str) -> None:
    """At most MAX_JSON_DEPTH levels of objects and lists (iterative: no recursion to exhaust)."""
    level, depth = [obj], 1
    while level:
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"{field}: nested deeper than {MAX_JSON_DEPTH} levels")
        level = [
            v
            for node in level
            for v in (node.values() if isinstance(node, dict) else node)
            if isinstance(v, (dict, list))
        ]
        depth += 1


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = (
            _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


def fold_json(data: Any, text_key: str, obj_key: str, limit: int, deep: bool) -> Any:
    """Before validation: the JSON text at ``text_key`` merged over the object at ``obj_key``
    (the object itself bounded in depth too: the API server's schema types it, an API server
    that prunes differently may not)."""
    if isinstance(data, dict) and isinstance(data.get(obj_key), dict):
        _check_depth(data[obj_key], obj_key)
    if not isinstance(data, dict) or data.get(text_key) is None:
        return data
    parsed = _json_object(data[text_key], text_key, limit)
    base = data.get(obj_key)
    if base is not None and not isinstance(base, dict):
        return data  # the object's own type error is reported
    merged = _deep_merge(base or {}, parsed) if deep else {**(base or {}), **parsed}
    return {**data, obj_key: merged}
