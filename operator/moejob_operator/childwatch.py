"""Watches of the operator's own children, filtered by label on the API server, in threads.

kopf watches a resource in every watched namespace and matches labels on its side, so every pod and
ConfigMap event (the operator's own children included: 500 of them in a 100-job burst) went
through kopf's event loop: JSON decoding, a deep copy for its diff base, handler matching, on the
thread that also delivers the job events (a large share of the operator's CPU in a burst of new
jobs: docs/operator.md). These watches ask the API server only for the labelled
objects, decode each event with ``json.loads`` and hand the ones the handler wants to it; the
handler must be quick (handlers.py queues a pass, it does not run one).

A watch lists once (limit 1) for a resourceVersion, then streams from it with bookmarks, resuming
from the last version it saw; "410 Gone" (too old) starts over from a fresh list. Events missed
in between are covered by the job resync (workqueue.RESYNC_SECONDS).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any, cast

import urllib3
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from .reconcile.client import Client

log = logging.getLogger("moejob_operator")

WATCH_TIMEOUT_SECONDS = 60  # the server closes the stream after this; we resume at once
RETRY_SECONDS = (1.0, 30.0)  # after an error: first retry, doubling up to the cap

Handler = Callable[[str, dict[str, Any]], None]


class ChildWatch:
    """Watch ``kind`` ("pods" or "configmaps") with ``selector`` in ``namespaces`` (None = all)."""

    def __init__(
        self,
        api: k8s.ApiClient,
        kind: str,
        selector: str,
        handler: Handler,
        *,
        namespaces: list[str] | None = None,
    ):
        self.core = k8s.CoreV1Api(api)
        self._list_all: Callable[..., object]
        self._list_ns: Callable[..., object]
        if kind == "pods":
            self._list_all = self.core.list_pod_for_all_namespaces
            self._list_ns = self.core.list_namespaced_pod
        elif kind == "configmaps":
            self._list_all = self.core.list_config_map_for_all_namespaces
            self._list_ns = self.core.list_namespaced_config_map
        else:
            raise ValueError(f"ChildWatch: unsupported kind {kind!r}")
        self.kind, self.selector, self.handler = kind, selector, handler
        self.namespaces = namespaces
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> ChildWatch:
        everywhere: list[str | None] = [None]  # one watch of all namespaces
        for ns in self.namespaces or everywhere:
            t = threading.Thread(
                target=self._run,
                args=(ns,),
                daemon=True,
                name=f"moe-watch-{self.kind}-{ns or 'all'}",
            )
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        """Ask the threads to end: at the next event, bookmark or stream timeout. Closing the
        response from here would block on the reading thread's buffer lock (seen: a SIGTERM'd
        operator hung in HTTPResponse.close); the threads are daemons, so exiting never waits."""
        self._stop.set()

    def _call(self, ns: str | None, **kw: Any) -> urllib3.BaseHTTPResponse:
        kw.update(label_selector=self.selector, _preload_content=False)
        resp = self._list_all(**kw) if ns is None else self._list_ns(ns, **kw)
        return cast(urllib3.BaseHTTPResponse, resp)  # _preload_content=False: not the model

    def _current_version(self, ns: str | None) -> str:
        version: str = Client._json(self._call(ns, limit=1))["metadata"]["resourceVersion"]
        return version

    def _run(self, ns: str | None) -> None:
        first, cap = RETRY_SECONDS
        delay, version = first, None
        while not self._stop.is_set():
            try:
                if version is None:
                    version = self._current_version(ns)
                version = self._stream(ns, version)
                delay = first
            except ApiException as exc:
                if exc.status == 410:
                    version = None
                    continue
                log.warning(
                    "watch %s %s: API server said %s %s; again in %.0f s",
                    self.kind,
                    self.selector,
                    exc.status,
                    exc.reason,
                    delay,
                )
            except Exception as exc:  # noqa: BLE001 - a dropped stream must not end the watch
                if self._stop.is_set():
                    return
                log.warning(
                    "watch %s %s: %s; again in %.0f s", self.kind, self.selector, exc, delay
                )
            else:
                continue
            self._stop.wait(delay)
            delay = min(cap, delay * 2)

    def _stream(self, ns: str | None, version: str) -> str | None:
        """Stream events from ``version``; returns the version to resume from (None: re-list)."""
        resp = self._call(
            ns,
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_TIMEOUT_SECONDS,
            _request_timeout=(10, WATCH_TIMEOUT_SECONDS + 30),
        )
        try:
            for line in iter_resp_lines(resp):
                if self._stop.is_set():
                    return version
                if not line:
                    continue
                event = json.loads(line)
                etype, obj = event.get("type"), event.get("object") or {}
                if etype == "ERROR":
                    if obj.get("code") == 410:
                        return None
                    raise RuntimeError(f"watch error: {obj.get('message')}")
                version = (obj.get("metadata") or {}).get("resourceVersion") or version
                if etype in ("ADDED", "MODIFIED", "DELETED"):
                    try:
                        self.handler(etype, obj)
                    except Exception:  # one bad event must not end the watch
                        log.exception("watch %s: handler failed on %s", self.kind, etype)
            return version
        finally:
            resp.close()  # a stream left mid-way must not go back to the pool unread
            resp.release_conn()
