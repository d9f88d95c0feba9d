"""The operator's own child watches (server-side label selector, raw JSON events) against the
real API server: labelled objects only, ADDED/MODIFIED/DELETED in order, and the stream resumes
from its last resourceVersion when the server closes it."""

from __future__ import annotations

import threading
import time

import pytest

from moejob_operator import childwatch
from moejob_operator.childwatch import ChildWatch

pytestmark = pytest.mark.cluster


def cm(name: str, labels: dict | None = None, data: str = "1") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "labels": labels or {}},
        "data": {"k": data},
    }


def test_label_selected_events_in_order_and_resume(
    control_plane, kube, namespace, wait_for, monkeypatch
):
    monkeypatch.setattr(childwatch, "WATCH_TIMEOUT_SECONDS", 2)  # the server ends streams often
    seen: list[tuple[str, str, str]] = []
    lock = threading.Lock()

    def handler(etype, obj):
        with lock:
            seen.append((etype, obj["metadata"]["name"], obj["data"]["k"]))

    w = ChildWatch(
        control_plane.api_client(), "configmaps", "moe-test=yes", handler, namespaces=[namespace]
    )
    listed, streams = threading.Event(), []
    current_version, stream = w._current_version, w._stream

    def counted_version(ns):
        version = current_version(ns)
        listed.set()
        return version

    def counted_stream(ns, version):
        streams.append(version)
        return stream(ns, version)

    w._current_version, w._stream = counted_version, counted_stream
    w.start()
    try:
        # the watch streams from the version its list returned: what changes after it is seen
        wait_for(listed.is_set, timeout=60, message="the watch listed")
        kube.core.create_namespaced_config_map(namespace, cm("other", {"moe-test": "no"}))
        kube.core.create_namespaced_config_map(namespace, cm("mine", {"moe-test": "yes"}))
        kube.core.patch_namespaced_config_map("mine", namespace, {"data": {"k": "2"}})
        wait_for(lambda: len(seen) >= 2, timeout=10, message=f"events: {seen}")
        n = len(streams)
        wait_for(
            lambda: len(streams) > n,
            timeout=60,  # a stream ended (timeout) and resumed
            message="the watch resumed after its stream timeout",
        )
        kube.core.patch_namespaced_config_map("mine", namespace, {"data": {"k": "3"}})
        kube.core.delete_namespaced_config_map("mine", namespace)
        wait_for(lambda: len(seen) >= 4, timeout=10, message=f"events after resume: {seen}")
        time.sleep(0.5)
        with lock:
            assert seen == [
                ("ADDED", "mine", "1"),
                ("MODIFIED", "mine", "2"),
                ("MODIFIED", "mine", "3"),
                ("DELETED", "mine", "3"),
            ]
    finally:
        w.stop()
