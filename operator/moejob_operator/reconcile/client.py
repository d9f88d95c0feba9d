"""One small client over the Kubernetes API: reads return plain dicts, creates treat
"already exists" as success, deletes treat "not found" as success.

Reads use ``_preload_content=False`` and ``json.loads``: the generated models' deserialisation is
the operator's largest CPU cost otherwise, and everything above this module works on dicts.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from .. import constants as C
from ..status import now_iso
from .deferred import PassClock, YieldingQueue

EVENT_QUIET_SECONDS = 0.3  # Events wait until no pass has started for this long...
EVENT_MAX_DELAY_SECONDS = 5.0  # ...but never longer than this after they were raised
POOL_SIZE = 64  # > kopf's worker threads + create_all's + the event poster: a smaller pool drops
# connections and pays TLS handshakes
CREATE_THREADS = 16
TOKEN_REFRESH_SECONDS = 5.0
EVENT_QUEUE_MAX = 10000
log = logging.getLogger("moejob_operator")
RefreshHook = Callable[[k8s.Configuration], None]  # Configuration.refresh_api_key_hook


def api_client_from_env() -> k8s.ApiClient:
    """In-cluster credentials when present, else $KUBECONFIG / ~/.kube/config."""
    cfg = k8s.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=cfg)
    except k8s_config.ConfigException:
        k8s_config.load_kube_config(client_configuration=cfg)
    cfg.connection_pool_maxsize = POOL_SIZE
    # Configuration.__init__ sets the hook to None, so its inferred type is None; the loaders
    # above set a function (kubeconfig tokens, in-cluster token file)
    hook = cast(RefreshHook | None, cfg.refresh_api_key_hook)
    if hook is not None:
        cfg.refresh_api_key_hook = _at_most_every(hook, TOKEN_REFRESH_SECONDS)  # type: ignore[assignment]
    return k8s.ApiClient(cfg)


def _at_most_every(hook: RefreshHook, seconds: float) -> RefreshHook:
    """The client's token-refresh hook runs before *every* request and re-applies the whole
    configuration (setting ``host`` re-reads the proxy settings from the environment), a
    noticeable part of each request's client CPU. The tokens it refreshes are re-read within 5
    minutes of expiring (kubeconfig) or once a minute old (in-cluster, where the kubelet rotates
    them long before they expire), so checking every few seconds loses nothing."""
    lock = threading.Lock()
    last = [float("-inf")]

    def refresh(cfg: k8s.Configuration) -> None:
        with lock:
            now = time.monotonic()
            if now - last[0] < seconds:
                return
            last[0] = now
        hook(cfg)

    return refresh


class NotReady(Exception):
    """The API server asks to retry shortly (e.g. a new ServiceAccount has no token yet)."""


# Answers to a create that the same request will get again: invalid (400, 422), forbidden by
# admission (403: a missing PriorityClass, a policy), gone namespace (404), too large (413).
# 401 (the operator's credentials), 408, 429 and an exceeded ResourceQuota (403, frees up as
# other pods finish) are retried.
PERMANENT_CREATE_STATUSES = frozenset({400, 403, 404, 413, 422})


class Rejected(Exception):
    """The API server refused to create a child and will refuse it again (permanent 4xx)."""

    def __init__(self, kind: str, name: str, status: int, message: str):
        super().__init__(f"{kind} {name}: the API server refused it ({status}): {message}")
        self.kind, self.name, self.status, self.server_message = kind, name, status, message


def exceeded_quota(exc: ApiException) -> bool:
    """A 403 from ResourceQuota admission: it may pass once other objects are gone (retried)."""
    return exc.status == 403 and "exceeded quota" in server_message(exc)


def server_message(exc: ApiException) -> str:
    """The Status ``message`` of an API error (the body), else its reason."""
    try:
        msg = json.loads(exc.body or "{}").get("message")
    except (ValueError, AttributeError):
        msg = None
    return str(msg or exc.reason or exc.status)[:800]


class ChildConflict(Exception):
    """An object has a child's name but not this job's controller ownerReference (a neighbour's,
    or one left by another job): it is never used, changed or deleted; the job reports it."""

    def __init__(self, kind: str, name: str, owner: str | None):
        held = f"controlled by uid {owner}" if owner else "not controlled by this job"
        super().__init__(
            f"{kind} {name} exists and is {held}: the operator neither uses nor deletes it "
            "(delete or rename it to let the job continue)"
        )
        self.kind, self.name, self.owner = kind, name, owner


def controller_uid(obj: dict[str, Any] | None) -> str | None:
    """The uid of ``obj``'s controller ownerReference (None: none)."""
    for ref in ((obj or {}).get("metadata") or {}).get("ownerReferences") or ():
        if ref.get("controller"):
            uid: str | None = ref.get("uid")
            return uid
    return None


class PodGroupApi:
    """Volcano's PodGroups through the custom-objects API, under method names that say the
    resource (tests/test_rbac.py derives the chart's grants from them)."""

    def __init__(self, api: k8s.ApiClient):
        self._custom = k8s.CustomObjectsApi(api)
        self._at = (C.VOLCANO_GROUP, C.VOLCANO_VERSION)

    def create_namespaced_pod_group(
        self, namespace: str, body: dict[str, Any], **kw: Any
    ) -> object:
        return self._custom.create_namespaced_custom_object(
            *self._at, namespace, C.VOLCANO_PODGROUPS, body, **kw
        )

    def read_namespaced_pod_group(self, name: str, namespace: str, **kw: Any) -> object:
        return self._custom.get_namespaced_custom_object(
            *self._at, namespace, C.VOLCANO_PODGROUPS, name, **kw
        )

    def delete_namespaced_pod_group(self, name: str, namespace: str, **kw: Any) -> object:
        return self._custom.delete_namespaced_custom_object(
            *self._at, namespace, C.VOLCANO_PODGROUPS, name, **kw
        )


SERVED_RECHECK_SECONDS = 60.0  # an API not served is asked about again after this long


class Client:
    def __init__(self, api_client: k8s.ApiClient | None = None, *, node_cache_seconds: float = 2.0):
        self.api = api_client or api_client_from_env()
        self.core = k8s.CoreV1Api(self.api)
        self.custom = k8s.CustomObjectsApi(self.api)
        self.rbac = k8s.RbacAuthorizationV1Api(self.api)
        self.volcano = PodGroupApi(self.api)
        self._served: dict[str, tuple[float, bool]] = {}  # "group/version/plural" -> (when, served)
        self._node_cache: tuple[float, list[dict[str, Any]]] | None = None
        self._node_cache_seconds = node_cache_seconds
        self._cm_cache: dict[tuple[str, str], tuple[float, dict[str, Any] | None]] = {}
        self._lock = threading.Lock()
        self._pool: cf.ThreadPoolExecutor | None = None
        self.clock = PassClock()
        self._events = YieldingQueue(
            "moe-events",
            self.post_event,
            self.clock,
            quiet=EVENT_QUIET_SECONDS,
            max_delay=EVENT_MAX_DELAY_SECONDS,
            maxsize=EVENT_QUEUE_MAX,
        )

    # ---- helpers -------------------------------------------------------------------------
    @staticmethod
    def _json(resp: object) -> dict[str, Any]:
        """The JSON object in ``resp``'s body (every read here returns an object)."""
        doc: dict[str, Any] = json.loads(Client._done(resp))
        return doc

    @staticmethod
    def _done(resp: object) -> bytes:
        """Read the body and hand the connection back to the pool: with _preload_content=False
        urllib3 keeps it checked out otherwise, and every call pays a new TLS handshake.

        ``resp`` is what an API method returned with ``_preload_content=False``: urllib3's
        response, whatever model the generated method's annotation names."""
        raw = cast(urllib3.BaseHTTPResponse, resp)
        try:
            return raw.data
        finally:
            raw.release_conn()

    def _get(self, fn: Callable[..., object], *args: str, **kw: Any) -> dict[str, Any] | None:
        try:
            return self._json(fn(*args, _preload_content=False, **kw))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    # ---- the job -------------------------------------------------------------------------
    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get(
            self.custom.get_namespaced_custom_object, C.GROUP, C.VERSION, namespace, C.PLURAL, name
        )

    def jobs_planned_on(self, node: str) -> list[tuple[str, str]]:
        """(namespace, name) of every job whose plan uses ``node`` (from ``status.plan.nodes``)."""
        try:
            resp = self.custom.list_cluster_custom_object(
                C.GROUP, C.VERSION, C.PLURAL, _preload_content=False
            )
        except ApiException as exc:
            if exc.status == 403:  # watchNamespaces: no cluster-wide list; the resync timer acts
                return []
            raise
        return [
            (j["metadata"]["namespace"], j["metadata"]["name"])
            for j in self._json(resp)["items"]
            if node in (((j.get("status") or {}).get("plan") or {}).get("nodes") or ())
        ]

    def patch_job_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        try:
            self._done(
                self.custom.patch_namespaced_custom_object_status(
                    C.GROUP,
                    C.VERSION,
                    namespace,
                    C.PLURAL,
                    name,
                    {"status": status},
                    _preload_content=False,
                )
            )
        except ApiException as exc:
            if exc.status != 404:
                raise

    def delete_job(self, namespace: str, name: str) -> None:
        try:
            self._done(
                self.custom.delete_namespaced_custom_object(
                    C.GROUP,
                    C.VERSION,
                    namespace,
                    C.PLURAL,
                    name,
                    body=k8s.V1DeleteOptions(propagation_policy="Background"),
                    _preload_content=False,
                )
            )
        except ApiException as exc:
            if exc.status != 404:
                raise

    # ---- children ------------------------------------------------------------------------
    def create(self, obj: dict[str, Any]) -> bool:
        """Create ``obj``; False when it already exists (idempotent launch)."""
        ns = obj["metadata"].get("namespace")
        kind = obj["kind"]
        # the generated methods take the dict (their validate_call parses it into the model)
        creators: dict[str, Callable[..., object]] = {
            "ConfigMap": self.core.create_namespaced_config_map,
            "Service": self.core.create_namespaced_service,
            "Pod": self.core.create_namespaced_pod,
            "ServiceAccount": self.core.create_namespaced_service_account,
            "Role": self.rbac.create_namespaced_role,
            "RoleBinding": self.rbac.create_namespaced_role_binding,
            "PodGroup": self.volcano.create_namespaced_pod_group,
        }
        try:
            self._done(creators[kind](ns, obj, _preload_content=False))
            return True
        except ApiException as exc:
            if exc.status == 409:
                self._check_owner(obj)
                return False
            # 1.20's ServiceAccount admission refuses pods until the token controller has made
            # the account's token ("retry after the token is automatically created")
            if exc.status in (429, 500, 503) and "retry" in (exc.body or "").lower():
                raise NotReady(f"{kind} {obj['metadata']['name']}: {exc.reason}") from None
            if exc.status in PERMANENT_CREATE_STATUSES and not exceeded_quota(exc):
                raise Rejected(
                    kind, obj["metadata"]["name"], exc.status, server_message(exc)
                ) from None
            raise

    def _check_owner(self, obj: dict[str, Any]) -> None:
        """After "already exists": the existing object must have ``obj``'s controller (the same
        job, e.g. written by a pass that crashed), else :class:`ChildConflict`."""
        want = controller_uid(obj)
        if want is None:
            return
        meta = obj["metadata"]
        name, ns, kind = meta["name"], meta.get("namespace"), obj["kind"]
        readers: dict[str, Callable[..., object]] = {
            "ConfigMap": self.core.read_namespaced_config_map,
            "Service": self.core.read_namespaced_service,
            "Pod": self.core.read_namespaced_pod,
            "ServiceAccount": self.core.read_namespaced_service_account,
            "Role": self.rbac.read_namespaced_role,
            "RoleBinding": self.rbac.read_namespaced_role_binding,
            "PodGroup": self.volcano.read_namespaced_pod_group,
        }
        have = self._get(readers[kind], name, ns)
        if have is not None and controller_uid(have) != want:
            raise ChildConflict(kind, name, controller_uid(have))

    def create_all(
        self, objs: list[dict[str, Any]], *, claim: Sequence[dict[str, Any]] = ()
    ) -> list[bool]:
        """``create`` each of ``objs`` concurrently (independent children: one round trip of
        latency instead of one per object); results in order. ``claim``: children created later
        whose names must not be held now by an object another controller (or none) owns, read in
        the same round trip (:class:`ChildConflict`). Raises the first error after all have been
        tried."""
        if len(objs) + len(claim) <= 1:
            return [self.create(o) for o in objs]
        with self._lock:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(CREATE_THREADS, thread_name_prefix="moe-create")
        futures = [self._pool.submit(self.create, o) for o in objs]
        checks = [self._pool.submit(self._check_owner, o) for o in claim]
        cf.wait(futures)
        cf.wait(checks)
        created = [f.result() for f in futures]
        for f in checks:
            f.result()
        return created

    def serves(self, group: str, version: str, plural: str) -> bool:
        """Whether the API server serves ``plural`` in ``group/version`` (e.g. Volcano's
        PodGroups: its CRD is installed), from API discovery (allowed to every authenticated
        user: no RBAC). Cached in this client, so for the Controller's lifetime: a yes for good,
        a no for :data:`SERVED_RECHECK_SECONDS` (an API installed later is noticed)."""
        key = f"{group}/{version}/{plural}"
        with self._lock:
            hit = self._served.get(key)
        if hit is not None and (hit[1] or time.monotonic() - hit[0] < SERVED_RECHECK_SECONDS):
            return hit[1]
        try:
            doc = self._json(self.custom.get_api_resources(group, version, _preload_content=False))
            served = any(r.get("name") == plural for r in doc.get("resources") or ())
        except ApiException as exc:
            if exc.status != 404:
                raise
            served = False
        with self._lock:
            self._served[key] = (time.monotonic(), served)
        return served

    def get_pod_group(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get(self.volcano.read_namespaced_pod_group, name, namespace)

    def delete_pod_group(self, namespace: str, name: str, *, uid: str) -> None:
        """Delete the PodGroup ``name`` if it is still the object ``uid`` (a precondition)."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid}}
        try:
            self._done(
                self.volcano.delete_namespaced_pod_group(
                    name, namespace, body=body, _preload_content=False
                )
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def get_configmap(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get(self.core.read_namespaced_config_map, name, namespace)

    def get_configmap_cached(
        self, namespace: str, name: str, *, max_age: float = 2.0
    ) -> dict[str, Any] | None:
        """``get_configmap`` through a short-lived cache, for documents many jobs read at once
        (the namespace's ``moe-topology-<node>`` reports): a burst of jobs costs one GET per
        report and ``max_age``, not one per job. A report published meanwhile is seen at most
        ``max_age`` late."""
        key = (namespace, name)
        with self._lock:
            hit = self._cm_cache.get(key)
            if hit is not None and time.monotonic() - hit[0] < max_age:
                return hit[1]
        cm = self.get_configmap(namespace, name)
        with self._lock:
            if len(self._cm_cache) > 4096:
                self._cm_cache.clear()
            self._cm_cache[key] = (time.monotonic(), cm)
        return cm

    def get_owned_configmap(self, namespace: str, name: str, uid: str) -> dict[str, Any] | None:
        """The ConfigMap when the object ``uid`` controls it; None when absent;
        :class:`ChildConflict` when someone else's has the name."""
        cm = self.get_configmap(namespace, name)
        if cm is not None and controller_uid(cm) != uid:
            raise ChildConflict("ConfigMap", name, controller_uid(cm))
        return cm

    def replace_configmap(self, namespace: str, obj: dict[str, Any]) -> None:
        """Write ``obj`` over the ConfigMap it names; with ``metadata.resourceVersion`` set, a
        write since that read is a 409 (the pass fails and runs again on fresh reads)."""
        name = obj["metadata"]["name"]
        # the generated method takes the dict (its validate_call parses it into the model)
        replace: Callable[..., object] = self.core.replace_namespaced_config_map
        self._done(replace(name, namespace, obj, _preload_content=False))

    def delete_configmap(self, namespace: str, name: str) -> None:
        try:
            self._done(
                self.core.delete_namespaced_config_map(name, namespace, _preload_content=False)
            )
        except ApiException as exc:
            if exc.status != 404:
                raise

    def list_pods(self, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        sel = ",".join(f"{k}={v}" for k, v in selector.items())
        resp = self.core.list_namespaced_pod(namespace, label_selector=sel, _preload_content=False)
        items: list[dict[str, Any]] = self._json(resp)["items"]
        return items

    def list_owned_pods(
        self, namespace: str, selector: dict[str, str], uid: str
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """``list_pods`` split by controller: (the pods ``uid`` controls, the names of the
        others). Labels are anyone's to set: a pod counts only by its ownerReference."""
        owned, foreign = [], []
        for pod in self.list_pods(namespace, selector):
            if controller_uid(pod) == uid:
                owned.append(pod)
            else:
                foreign.append(pod["metadata"]["name"])
        return owned, foreign

    def delete_pod(
        self, namespace: str, name: str, *, uid: str | None = None, grace_seconds: int | None = None
    ) -> None:
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if uid:
            body["preconditions"] = {"uid": uid}  # never delete a newer pod of the same name
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        try:
            self._done(
                # the body is a dict: validate_call parses it into V1DeleteOptions (the
                # annotation names only the model)
                self.core.delete_namespaced_pod(
                    name,
                    namespace,
                    body=body,  # type: ignore[arg-type]
                    _preload_content=False,
                )
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def list_nodes(self) -> list[dict[str, Any]]:
        """All nodes, cached for a couple of seconds (many jobs reconcile at once)."""
        with self._lock:
            now = time.monotonic()
            if self._node_cache and now - self._node_cache[0] < self._node_cache_seconds:
                return self._node_cache[1]
        items: list[dict[str, Any]] = self._json(self.core.list_node(_preload_content=False))[
            "items"
        ]
        with self._lock:
            self._node_cache = (time.monotonic(), items)
        return items

    def forget_nodes(self) -> None:
        with self._lock:
            self._node_cache = None

    # ---- events --------------------------------------------------------------------------
    def pass_started(self) -> None:
        """A reconcile pass begins: deferred writes (Events, ...) hold back (``deferred``)."""
        self.clock.started()

    def event(self, job: dict[str, Any], etype: str, reason: str, message: str) -> None:
        """Queue an Event; one background thread posts them in order. A reconcile pass does not
        wait for its Events (best effort anyway), and the poster yields to passes: while passes
        keep starting (a burst of new jobs) it waits until none has started for
        ``EVENT_QUIET_SECONDS``, at most ``EVENT_MAX_DELAY_SECONDS`` after the Event was raised
        (its timestamps are those of the transition). So the writes that move jobs on get the
        API server first (Events are a large share of a burst's requests: the operator benchmark
        counts them by verb and resource)."""
        if not self._events.put(self._event_body(job, etype, reason, message)):
            log.warning("event queue full: dropping %s %s", reason, message[:80])

    def flush_events(self, timeout: float = 10.0) -> bool:
        """Wait until every queued Event is posted (tests, shutdown); False on timeout."""
        return self._events.drain(timeout)

    @staticmethod
    def _event_body(job: dict[str, Any], etype: str, reason: str, message: str) -> dict[str, Any]:
        meta = job["metadata"]
        now = now_iso()
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": C.API_VERSION,
                "kind": C.KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "type": etype,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": C.MANAGED_BY},
            "reportingComponent": C.MANAGED_BY,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }

    def post_event(self, body: dict[str, Any]) -> None:
        try:
            self._done(
                # the body is a dict: validate_call parses it into CoreV1Event (the annotation
                # names only the model)
                self.core.create_namespaced_event(
                    body["metadata"]["namespace"],
                    body,  # type: ignore[arg-type]
                    _preload_content=False,
                )
            )
        except Exception as exc:  # noqa: BLE001 - an Event is best effort; never kill the poster
            log.debug("event not posted: %s", exc)
