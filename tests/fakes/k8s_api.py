"""FakeKubernetesApiServer: a local HTTP server that speaks Kubernetes' REST API for JobSets.

A FAKE, not a cluster: nothing is scheduled and no controller runs. It exists so that the
real ``kubernetes`` Python client can be tested over real HTTP against the real paths and
object shapes:

* ``/apis/jobset.x-k8s.io/v1alpha2/namespaces/{ns}/jobsets`` -- POST (201, or 409
  ``AlreadyExists``), GET list, GET ``?watch=true`` (chunked stream of watch events, with
  ``resourceVersion``, ``fieldSelector=metadata.name=...`` and ``timeoutSeconds``);
* ``/apis/jobset.x-k8s.io/v1alpha2/namespaces/{ns}/jobsets/{name}`` -- GET, DELETE
  (``DeleteOptions`` body: ``propagationPolicy``, ``preconditions.uid``; 404 when absent);
* ``/api/v1/namespaces/{ns}/pods?labelSelector=k=v,...`` -- PodList;
* ``/api/v1/namespaces/{ns}/pods/{name}/log?tailLines=N`` -- text/plain.

Errors are ``Status`` objects (401 ``Unauthorized``, 403 ``Forbidden``, 404 ``NotFound``, 409
``AlreadyExists``/``Conflict``, 422 ``Invalid``, 500 ``InternalError``...). A created JobSet
is validated as the API server validates it (:func:`invalid_fields`): its name, the vendored
JobSet CRD's schema, and the labels and annotation keys of its own and its templates' metadata;
a body the server would refuse is answered 422 and not created. Every request must carry
``Authorization: Bearer <token>`` with a token in :attr:`tokens`: tests rotate it to exercise
credential refresh.

The test plays the JobSet controller through the hooks below: :meth:`restart` (pods recreated
with the next ``restart-attempt``), :meth:`complete`, :meth:`fail` (a reason and exit codes),
:meth:`set_condition`, :meth:`log` (lines in the leader pod's log), :meth:`delete` (from
outside), :meth:`inject` (the next
matching requests fail with a given status), :attr:`hold_deletions` (foreground deletion stays
pending until :meth:`finish_deletions`), :attr:`on_create` (called with the namespace and the
new object after each JobSet is created, before the POST is answered: a controller that acts at
once, e.g. runs a short JobSet to its end). :attr:`created` keeps every accepted POST body as
received; :attr:`deletions` every DELETE's options; :attr:`requests` every request.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from tests.support.jobset_crd import crd_validator

GROUP = "jobset.x-k8s.io"
API_VERSION = f"{GROUP}/v1alpha2"

JOBSET_NAME_KEY = "jobset.sigs.k8s.io/jobset-name"
RJOB_KEY = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX_KEY = "jobset.sigs.k8s.io/job-index"
JOB_GLOBAL_INDEX_KEY = "jobset.sigs.k8s.io/job-global-index"
RESTART_KEY = "jobset.sigs.k8s.io/restart-attempt"
COMPLETION_KEY = "batch.kubernetes.io/job-completion-index"

_JOBSETS = re.compile(
    r"^/apis/jobset\.x-k8s\.io/v1alpha2/namespaces/(?P<ns>[^/]+)/jobsets(?:/(?P<name>[^/]+))?$"
)
_PODS = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods$")
_POD_LOG = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods/(?P<name>[^/]+)/log$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# ObjectMeta's rules (apimachinery validation), matched with fullmatch.
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_VALUE_RE = "(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?"
_LABEL_VALUE = re.compile(_LABEL_VALUE_RE)
_NAME_PART = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def status_object(
    code: int, reason: str, message: str, details: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A ``metav1.Status`` failure, as the API server sends it."""
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        body["details"] = dict(details)
    return body


_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    410: "Expired",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
}


class ApiError(Exception):
    """Raised inside a handler: answered with a Status object."""

    def __init__(self, code: int, message: str, reason: str | None = None, **details: Any):
        super().__init__(message)
        self.body = status_object(code, reason or _REASONS.get(code, "Unknown"), message, details)
        self.code = code


@dataclass
class Injected:
    """The next ``times`` requests matching ``method``/``path`` fail with ``status``."""

    status: int
    method: str | None
    path: str | None  # a substring of the request path
    times: int
    message: str


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: Mapping[str, str]
    body: Any
    token: str | None


class FakeKubernetesApiServer:
    """A FAKE Kubernetes API server for JobSets and pods (see the module docstring)."""

    def __init__(self, token: str = "fake-token-1") -> None:
        self._cond = threading.Condition()
        self.tokens: set[str] = {token}
        self.jobsets: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.logs: dict[tuple[str, str], list[str]] = {}
        self.requests: list[Request] = []
        self.created: list[dict[str, Any]] = []
        self.deletions: list[dict[str, Any]] = []
        self.hold_deletions = False
        self.on_create: Callable[[str, dict[str, Any]], None] | None = None
        self.min_watch_version = 0  # watches from below this get a 410 Expired ERROR event
        self._events: list[tuple[int, str, str, dict[str, Any]]] = []  # (rv, ns, type, obj)
        self._injected: list[Injected] = []
        self._rv = 1000
        self._stopping = False
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the fake first"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeKubernetesApiServer:
        handler = type("_Handler", (_Handler,), {"fake": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()  # open watch streams end
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeKubernetesApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def write_kubeconfig(
        self,
        path: Path,
        token: str | None = None,
        context: str = "fake",
        namespace: str = "default",
    ) -> Path:
        """A kubeconfig pointing at this fake (plain http, bearer token)."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": token or next(iter(self.tokens))}}],
            "contexts": [
                {
                    "name": context,
                    "context": {"cluster": "fake", "user": "fake", "namespace": namespace},
                }
            ],
            "current-context": context,
        }
        path.write_text(json.dumps(config))  # JSON is YAML
        return path

    # -- test hooks: credentials and failures ------------------------------------------------

    def accept_tokens(self, *tokens: str) -> None:
        """Only these bearer tokens are valid from now on (the old ones 'expired')."""
        with self._cond:
            self.tokens = set(tokens)

    def inject(
        self,
        status: int,
        *,
        method: str | None = None,
        path: str | None = None,
        times: int = 1,
        message: str | None = None,
    ) -> None:
        with self._cond:
            self._injected.append(
                Injected(status, method, path, times, message or f"injected {status}")
            )

    def requests_to(self, method: str, path_part: str = "") -> list[Request]:
        return [r for r in self.requests if r.method == method and path_part in r.path]

    # -- test hooks: the JobSet controller's part --------------------------------------------

    def jobset(self, namespace: str, name: str) -> dict[str, Any]:
        with self._cond:
            return copy.deepcopy(self.jobsets[(namespace, name)])

    def restart(
        self, namespace: str, name: str, *, counted: bool = True, exit_code: int = 42
    ) -> None:
        """A restart: the running pods exit with ``exit_code`` and all are recreated."""
        with self._cond:
            obj = self.jobsets[(namespace, name)]
            for pod in self._pods_of(namespace, name):
                _terminate(pod, exit_code)
            for key in [k for k, p in self.pods.items() if _owned(p, namespace, name)]:
                del self.pods[key]
            status = obj["status"]
            status["restarts"] = int(status.get("restarts", 0)) + 1
            if counted:
                status["restartsCountTowardsMax"] = (
                    int(status.get("restartsCountTowardsMax", 0)) + 1
                )
            self._make_pods(obj, status["restarts"])
            self._changed(namespace, obj)

    def complete(self, namespace: str, name: str) -> None:
        self._finish(
            namespace, name, "Completed", "AllJobsCompleted", "jobset completed successfully", 0
        )

    def fail(
        self,
        namespace: str,
        name: str,
        reason: str = "ReachedMaxRestarts",
        message: str = "jobset failed due to reaching max number of restarts",
        exit_code: int = 1,
    ) -> None:
        self._finish(namespace, name, "Failed", reason, message, exit_code)

    def set_condition(
        self, namespace: str, name: str, type_: str, reason: str, message: str, status: str = "True"
    ) -> None:
        with self._cond:
            obj = self.jobsets[(namespace, name)]
            _put_condition(obj, type_, status, reason, message)
            self._changed(namespace, obj)

    def log(self, namespace: str, name: str, *lines: str) -> str:
        """Append lines to the leader pod's log (slice 0, worker 0, newest attempt)."""
        with self._cond:
            leader = self.leader_pod(namespace, name)
            self.logs.setdefault((namespace, leader), []).extend(lines)
            return leader

    def leader_pod(self, namespace: str, name: str) -> str:
        with self._cond:
            pods = [
                p
                for p in self._pods_of(namespace, name)
                if p["metadata"]["labels"].get(JOB_INDEX_KEY) == "0"
                and p["metadata"]["labels"].get(COMPLETION_KEY) == "0"
            ]
            return pods[-1]["metadata"]["name"]

    def delete(self, namespace: str, name: str) -> None:
        """Someone else deletes the JobSet (``kubectl delete``): gone at once."""
        with self._cond:
            self._remove(namespace, name)

    def finish_deletions(self) -> None:
        """Foreground deletions held by :attr:`hold_deletions` complete now."""
        with self._cond:
            for (ns, name), obj in list(self.jobsets.items()):
                if obj["metadata"].get("deletionTimestamp"):
                    self._remove(ns, name)

    # -- internals: state ---------------------------------------------------------------------

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _changed(self, namespace: str, obj: dict[str, Any], type_: str = "MODIFIED") -> None:
        obj["metadata"]["resourceVersion"] = self._next_rv()
        self._events.append((self._rv, namespace, type_, copy.deepcopy(obj)))
        self._cond.notify_all()

    def _pods_of(self, namespace: str, name: str) -> list[dict[str, Any]]:
        return [p for p in self.pods.values() if _owned(p, namespace, name)]

    def _make_pods(self, obj: dict[str, Any], attempt: int) -> None:
        meta = obj["metadata"]
        ns, name = meta["namespace"], meta["name"]
        global_index = 0
        for rjob in obj["spec"].get("replicatedJobs") or ():
            jspec = rjob["template"]["spec"]
            ptemplate = jspec["template"]
            container = ptemplate["spec"]["containers"][0]
            completions = int(jspec.get("completions", jspec.get("parallelism", 1)))
            for j in range(int(rjob.get("replicas", 1))):
                job = f"{name}-{rjob['name']}-{j}"
                for i in range(completions):
                    suffix = hashlib.sha256(f"{meta['uid']}/{attempt}/{j}/{i}".encode()).hexdigest()
                    pod_name = f"{job}-{i}-{suffix[:5]}"
                    keys = {
                        JOBSET_NAME_KEY: name,
                        RJOB_KEY: rjob["name"],
                        JOB_INDEX_KEY: str(j),
                        JOB_GLOBAL_INDEX_KEY: str(global_index),
                        RESTART_KEY: str(attempt),
                        COMPLETION_KEY: str(i),
                        "batch.kubernetes.io/job-name": job,
                        "job-name": job,
                    }
                    labels = {**(ptemplate.get("metadata") or {}).get("labels", {}), **keys}
                    self.pods[(ns, pod_name)] = {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "metadata": {
                            "name": pod_name,
                            "namespace": ns,
                            "uid": str(uuid.uuid4()),
                            "labels": labels,
                            "annotations": dict(keys),
                            "creationTimestamp": _now(),
                            "resourceVersion": self._next_rv(),
                            "ownerReferences": [
                                {
                                    "apiVersion": "batch/v1",
                                    "kind": "Job",
                                    "name": job,
                                    "uid": str(
                                        uuid.uuid5(
                                            uuid.NAMESPACE_URL, f"{meta['uid']}/{job}/{attempt}"
                                        )
                                    ),
                                    "controller": True,
                                    "blockOwnerDeletion": True,
                                }
                            ],
                        },
                        "spec": {
                            "containers": [
                                {"name": container["name"], "image": container.get("image", "")}
                            ]
                        },
                        "status": {
                            "phase": "Running",
                            "containerStatuses": [
                                {
                                    "name": container["name"],
                                    "ready": True,
                                    "restartCount": 0,
                                    "image": container.get("image", ""),
                                    "imageID": "",
                                    "state": {"running": {"startedAt": _now()}},
                                }
                            ],
                        },
                    }
                global_index += 1

    def _finish(
        self, namespace: str, name: str, state: str, reason: str, message: str, exit_code: int
    ) -> None:
        with self._cond:
            obj = self.jobsets[(namespace, name)]
            for pod in self._pods_of(namespace, name):
                _terminate(pod, exit_code)
            obj["status"]["terminalState"] = state
            _put_condition(obj, state, "True", reason, message)
            self._changed(namespace, obj)

    def _remove(self, namespace: str, name: str) -> None:
        obj = self.jobsets.pop((namespace, name))
        for key in [k for k, p in self.pods.items() if _owned(p, namespace, name)]:
            del self.pods[key]
        self._changed(namespace, obj, "DELETED")

    # -- internals: request handling ----------------------------------------------------------

    def admit(
        self, method: str, path: str, query: Mapping[str, str], body: Any, token: str | None
    ) -> None:
        """Record the request, check its bearer token, apply injected failures."""
        with self._cond:
            self.requests.append(Request(method, path, dict(query), copy.deepcopy(body), token))
            if token not in self.tokens:
                raise ApiError(401, "Unauthorized")
            for inj in self._injected:
                if inj.times > 0 and inj.method in (None, method) and (inj.path or "") in path:
                    inj.times -= 1
                    raise ApiError(inj.status, inj.message)

    def handle(
        self, method: str, path: str, query: Mapping[str, str], body: Any, token: str | None
    ) -> tuple[int, Any]:
        """One request -> (HTTP status, JSON body or text). Watches go to :meth:`watch_events`."""
        self.admit(method, path, query, body, token)
        with self._cond:
            if m := _JOBSETS.match(path):
                return self._jobsets(method, m["ns"], m["name"], query, body)
            if (m := _PODS.match(path)) and method == "GET":
                return 200, self._list_pods(m["ns"], query.get("labelSelector", ""))
            if (m := _POD_LOG.match(path)) and method == "GET":
                return 200, self._pod_log(m["ns"], m["name"], query)
            raise ApiError(404, "the server could not find the requested resource")

    def _jobsets(
        self, method: str, ns: str, name: str | None, query: Mapping[str, str], body: Any
    ) -> tuple[int, Any]:
        if name is None and method == "POST":
            return 201, self._create(ns, body)
        if name is None and method == "GET":
            items = [copy.deepcopy(o) for (n, _), o in sorted(self.jobsets.items()) if n == ns]
            return 200, {
                "apiVersion": API_VERSION,
                "kind": "JobSetList",
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            }
        if name is not None and method == "GET":
            return 200, copy.deepcopy(self._get(ns, name))
        if name is not None and method == "DELETE":
            return self._delete(ns, name, query, body or {})
        raise ApiError(405, f"method {method} not allowed", reason="MethodNotAllowed")

    def _get(self, ns: str, name: str) -> dict[str, Any]:
        try:
            return self.jobsets[(ns, name)]
        except KeyError:
            raise ApiError(
                404,
                f'jobsets.{GROUP} "{name}" not found',
                name=name,
                group=GROUP,
                kind="jobsets",
            ) from None

    def _create(self, ns: str, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        if body.get("apiVersion") != API_VERSION or body.get("kind") != "JobSet":
            raise ApiError(400, f"expected {API_VERSION} JobSet")
        meta = body.get("metadata") or {}
        name = meta.get("name", "")
        if not _DNS_LABEL.match(name) or len(name) > 63:
            raise ApiError(422, f'JobSet.{GROUP} "{name}" is invalid: metadata.name')
        if problems := invalid_fields(body):
            raise ApiError(
                422,
                f'JobSet.{GROUP} "{name}" is invalid: ' + "; ".join(problems),
                name=name,
                group=GROUP,
                kind="JobSet",
                causes=[{"reason": "FieldValueInvalid", "message": p} for p in problems],
            )
        if meta.get("namespace", ns) != ns:
            raise ApiError(
                400,
                "the namespace of the provided object does not match the namespace sent on "
                "the request",
            )
        if (ns, name) in self.jobsets:
            raise ApiError(
                409,
                f'jobsets.{GROUP} "{name}" already exists',
                reason="AlreadyExists",
                name=name,
                group=GROUP,
                kind="jobsets",
            )
        self.created.append(copy.deepcopy(body))
        obj = copy.deepcopy(body)
        obj["metadata"] = {
            **meta,
            "namespace": ns,
            "uid": str(uuid.uuid4()),
            "generation": 1,
            "creationTimestamp": _now(),
        }
        rjobs = obj["spec"].get("replicatedJobs") or ()
        obj["status"] = {
            "restarts": 0,
            "restartsCountTowardsMax": 0,
            "replicatedJobsStatus": [
                {
                    "name": r["name"],
                    "active": int(r.get("replicas", 1)),
                    "ready": 0,
                    "succeeded": 0,
                    "failed": 0,
                    "suspended": 0,
                }
                for r in rjobs
            ],
        }
        self._make_pods(obj, 0)
        self.jobsets[(ns, name)] = obj
        self._changed(ns, obj, "ADDED")
        answer = copy.deepcopy(obj)  # as created: what the controller does next is not in it
        if self.on_create is not None:
            self.on_create(ns, copy.deepcopy(obj))
        return answer

    def _delete(
        self, ns: str, name: str, query: Mapping[str, str], options: Mapping[str, Any]
    ) -> tuple[int, Any]:
        obj = self._get(ns, name)
        policy = options.get("propagationPolicy") or query.get("propagationPolicy") or "Background"
        want_uid = (options.get("preconditions") or {}).get("uid")
        self.deletions.append({"name": name, "namespace": ns, **copy.deepcopy(dict(options))})
        if want_uid and want_uid != obj["metadata"]["uid"]:
            raise ApiError(
                409,
                f"Precondition failed: UID in precondition: {want_uid}, UID in object meta: "
                f"{obj['metadata']['uid']}",
            )
        if not obj["metadata"].get("deletionTimestamp"):
            obj["metadata"]["deletionTimestamp"] = _now()
            if policy == "Foreground":
                obj["metadata"]["finalizers"] = ["foregroundDeletion"]
            self._changed(ns, obj)
        if self.hold_deletions:
            return 202, copy.deepcopy(obj)  # accepted; dependents are still being removed
        self._remove(ns, name)
        return 200, copy.deepcopy(obj)

    def _list_pods(self, ns: str, selector: str) -> dict[str, Any]:
        wanted = _parse_selector(selector)
        items = [
            copy.deepcopy(p)
            for (n, _), p in self.pods.items()
            if n == ns and all(p["metadata"]["labels"].get(k) == v for k, v in wanted.items())
        ]
        return {
            "apiVersion": "v1",
            "kind": "PodList",
            "metadata": {"resourceVersion": str(self._rv)},
            "items": items,
        }

    def _pod_log(self, ns: str, name: str, query: Mapping[str, str]) -> str:
        if (ns, name) not in self.pods:
            raise ApiError(404, f'pods "{name}" not found', name=name, kind="pods")
        lines = self.logs.get((ns, name), [])
        if "tailLines" in query:
            lines = lines[-int(query["tailLines"]) :] if int(query["tailLines"]) else []
        return "".join(f"{line}\n" for line in lines)

    def watch_events(self, ns: str, query: Mapping[str, str]) -> Iterator[dict[str, Any]]:
        """Watch events for jobsets in ``ns`` after ``resourceVersion`` until ``timeoutSeconds``."""
        name = None
        for part in filter(None, query.get("fieldSelector", "").split(",")):
            key, _, value = part.partition("=")
            if key != "metadata.name":
                raise ApiError(400, f'field label not supported: "{key}"')
            name = value.lstrip("=")
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        first: list[dict[str, Any]] = []  # built under the lock, sent without holding it
        with self._cond:
            since = int(query.get("resourceVersion") or 0)
            if since and since < self.min_watch_version:
                gone = f"too old resource version: {since} ({self._rv})"
                first.append({"type": "ERROR", "object": status_object(410, "Expired", gone)})
                since = -1
            elif not since:  # no version: the current objects first, as ADDED
                first = [
                    {"type": "ADDED", "object": copy.deepcopy(obj)}
                    for (n, nm), obj in sorted(self.jobsets.items())
                    if n == ns and name in (None, nm)
                ]
                since = self._rv
        yield from first
        if since < 0:
            return
        while True:
            with self._cond:
                pending = [
                    (rv, t, o)
                    for rv, n, t, o in self._events
                    if rv > since and n == ns and name in (None, o["metadata"]["name"])
                ]
                if not pending:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._stopping:
                        return
                    self._cond.wait(min(left, 0.5))
                    continue
            for rv, type_, obj in pending:
                since = rv
                yield {"type": type_, "object": obj}


class _Handler(BaseHTTPRequestHandler):
    fake: FakeKubernetesApiServer
    protocol_version = "HTTP/1.1"  # keep-alive, chunked watch streams

    def log_message(self, format: str, *args: Any) -> None:  # quiet test output
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        query = dict(parse_qsl(url.query))
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        auth = self.headers.get("Authorization") or ""
        token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else None
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            self._send(400, status_object(400, "BadRequest", "invalid JSON body"))
            return
        watching = query.get("watch") in ("true", "1") and method == "GET"
        try:
            if watching and (m := _JOBSETS.match(url.path)) and not m["name"]:
                # Auth, injected failures and the request record, as for any request.
                self.fake.admit("WATCH", url.path, query, None, token)
                self._stream(self.fake.watch_events(m["ns"], query))
                return
            code, payload = self.fake.handle(method, url.path, query, body, token)
        except ApiError as err:
            self._send(err.code, err.body)
            return
        self._send(code, payload)

    def _send(self, code: int, payload: Any) -> None:
        if isinstance(payload, str):
            data, ctype = payload.encode(), "text/plain"
        else:
            data, ctype = json.dumps(payload).encode(), "application/json"
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, events: Iterator[dict[str, Any]]) -> None:
        try:
            first = next(events, None)
        except ApiError as err:  # raised before anything was sent: a plain error reply
            self._send(err.code, err.body)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            if first is not None:
                self._chunk(json.dumps(first).encode() + b"\n")
                for event in events:
                    self._chunk(json.dumps(event).encode() + b"\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):  # the client stopped watching
            self.close_connection = True

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def _owned(pod: Mapping[str, Any], namespace: str, name: str) -> bool:
    meta = pod["metadata"]
    return meta["namespace"] == namespace and meta["labels"].get(JOBSET_NAME_KEY) == name


def _terminate(pod: dict[str, Any], exit_code: int) -> None:
    pod["status"]["phase"] = "Succeeded" if exit_code == 0 else "Failed"
    for cs in pod["status"]["containerStatuses"]:
        cs["ready"] = False
        cs["state"] = {
            "terminated": {
                "exitCode": exit_code,
                "reason": "Completed" if exit_code == 0 else "Error",
                "finishedAt": _now(),
            }
        }


def _put_condition(obj: dict[str, Any], type_: str, status: str, reason: str, message: str) -> None:
    conditions = [c for c in obj["status"].get("conditions") or () if c["type"] != type_]
    conditions.append(
        {
            "type": type_,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": _now(),
        }
    )
    obj["status"]["conditions"] = conditions


def _parse_selector(selector: str) -> dict[str, str]:
    wanted: dict[str, str] = {}
    for part in filter(None, selector.split(",")):
        key, sep, value = part.partition("=")
        if not sep or key.endswith("!"):
            raise ApiError(400, f"unsupported label selector {part!r} (the fake knows k=v)")
        wanted[key.strip()] = value.lstrip("=").strip()
    return wanted


# -- what the API server refuses at create (422 Invalid) ---------------------------------------


def invalid_fields(body: Mapping[str, Any]) -> list[str]:
    """Why the API server would refuse this JobSet (none: it is accepted), in its words.

    * The body against the JobSet CRD's OpenAPI schema (types, enums, required fields,
      bounds), as the server validates a custom resource. Unknown fields are not refused: the
      server prunes them (with a warning), and this fake keeps the body as sent.
    * ObjectMeta's rules for the JobSet's labels (keys: qualified names; values: at most 63
      characters of letters, digits, '-', '_' and '.', starting and ending with a letter or
      digit) and annotation keys; and the same for the Job and pod templates' metadata,
      which the JobSet controller's Jobs and pods would be refused for. Nothing is scheduled
      here, so this fake refuses those at create too instead of leaving the JobSet stuck.
    """
    problems = [
        f"{'.'.join(map(str, e.absolute_path)) or '<body>'}: {e.message}"
        for e in crd_validator(reject_unknown=False).iter_errors(body)
    ]
    problems += _meta_problems(body.get("metadata"), "metadata")
    spec = body.get("spec") if isinstance(body.get("spec"), Mapping) else {}
    for i, rjob in enumerate(spec.get("replicatedJobs") or ()):
        if not isinstance(rjob, Mapping):
            continue
        job = rjob.get("template") if isinstance(rjob.get("template"), Mapping) else {}
        path = f"spec.replicatedJobs[{i}].template"
        problems += _meta_problems(job.get("metadata"), f"{path}.metadata")
        job_spec = job.get("spec") if isinstance(job.get("spec"), Mapping) else {}
        pod = job_spec.get("template")
        if isinstance(pod, Mapping):
            problems += _meta_problems(pod.get("metadata"), f"{path}.spec.template.metadata")
    return problems


def _meta_problems(meta: Any, path: str) -> list[str]:
    if not isinstance(meta, Mapping):
        return []
    problems = []
    labels = meta.get("labels") or {}
    for key, value in labels.items():
        problems += [f"{path}.labels: {p}" for p in _qualified_name_problems(key)]
        if not isinstance(value, str):
            problems.append(f"{path}.labels: Invalid value: {value!r}: must be a string")
            continue
        if len(value) > 63:
            problems.append(
                f'{path}.labels: Invalid value: "{value}": must be no more than 63 characters'
            )
        if not _LABEL_VALUE.fullmatch(value):
            problems.append(
                f'{path}.labels: Invalid value: "{value}": a valid label must be an empty '
                "string or consist of alphanumeric characters, '-', '_' or '.', and must start "
                "and end with an alphanumeric character (regex used for validation is "
                f"'{_LABEL_VALUE_RE}')"
            )
    for key in meta.get("annotations") or {}:
        problems += [f"{path}.annotations: {p}" for p in _qualified_name_problems(key)]
    return problems


def _qualified_name_problems(key: Any) -> list[str]:
    if not isinstance(key, str) or not key:
        return [f"Invalid value: {key!r}: name part must be non-empty"]
    if key.count("/") > 1:
        return [
            f'Invalid value: "{key}": a qualified name must consist of an optional DNS '
            "subdomain prefix, '/' and a name"
        ]
    prefix, slash, name = key.rpartition("/")
    problems = []
    if slash and (not _DNS_SUBDOMAIN.fullmatch(prefix) or len(prefix) > 253):
        problems.append(
            f'Invalid value: "{key}": prefix part a lowercase RFC 1123 subdomain must consist '
            "of lower case alphanumeric characters, '-' or '.', and must start and end with an "
            "alphanumeric character"
        )
    if len(name) > 63 or not _NAME_PART.fullmatch(name):
        problems.append(
            f'Invalid value: "{key}": name part must consist of alphanumeric characters, '
            "'-', '_' or '.', and must start and end with an alphanumeric character, at most "
            "63 characters"
        )
    return problems
