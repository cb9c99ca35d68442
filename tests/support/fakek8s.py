"""A Kubernetes API server stand-in whose pods are real processes: bare Debian roots, each in a
network namespace of its own. Root only.

`FakeCluster` starts it as a process of its own (``python -m tests.support.fakek8s CONFIG``)
and writes a kubeconfig for it; everything a test does to the cluster then goes through the
same HTTPS API the provider and ``kubectl`` use. What it speaks, as the official clients use it:

- HTTPS with a CA of its own (in the kubeconfig's ``certificate-authority-data``) and bearer
  tokens, each a user; a wrong token is 401, a verb the user's rules deny is 403 with the API
  server's words, answered as well by ``SelfSubjectAccessReview``;
- namespaces (read; one may have a ResourceQuota on its pods, refused as admission refuses
  them: 403 ``exceeded quota``), nodes (list), pods and services (create, get, list, delete;
  label and field selectors; ``?watch=true`` streams with ``timeoutSeconds``, starting with the
  current objects as ``ADDED``), events (list, by ``involvedObject.name``), a pod's log
  (``tailLines``);
- exec over the websocket, subprotocols ``v5.channel.k8s.io`` and ``v4.channel.k8s.io`` (a
  config may offer v4 only, as a cluster before 1.30): channel 0 stdin, 1 stdout, 2 stderr,
  3 the command's end as a ``Status`` (``Success``, or ``NonZeroExitCode`` with its
  ``ExitCode`` cause, as the kubelet sends), v5's ``[255, 0]`` closing stdin; the command runs
  in every namespace of the container (``runc exec``), and the stream's end closes its stdin;
- a scheduler that counts ``nvidia.com/gpu`` on its nodes and honours node affinity and taints,
  and a kubelet (`tests.support.fakekubelet`) that pulls only images it knows.

What it cannot imitate: admission, quotas, controllers other than the pod's own life (no
Deployments, no garbage collection by owner), a real DNS (each pod's ``/etc/hosts`` holds the
names of its headless Service's pods instead), a CNI, image pulls, cgroups and devices.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import ipaddress
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
V5, V4 = "v5.channel.k8s.io", "v4.channel.k8s.io"
WATCH_LIMIT = 1800


# ================================================================== the test's handle


@dataclass
class User:
    """A token's user and the (verb, resource[/subresource]) pairs denied to it anywhere."""

    name: str
    deny: list[str] = field(default_factory=list)


class FakeCluster:
    """The stand-in as a test holds it: start it, point ``KUBECONFIG`` at `kubeconfig`, ask it
    what it holds (`pods`), stop it (every pod's processes and namespace go with it)."""

    def __init__(
        self,
        workdir: Path,
        *,
        subnet: str,
        images: Mapping[str, str | list[str]],
        nodes: list[dict[str, Any]] | None = None,
        namespaces: tuple[str, ...] = ("default",),
        users: Mapping[str, User] | None = None,
        protocols: tuple[str, ...] = (V5, V4),
        pod_quotas: Mapping[str, int] | None = None,
        context: str = "fake",
        context_namespace: str | None = None,
    ) -> None:
        self.workdir = workdir
        self.context = context
        self.users = dict(users or {"alice": User("alice")})
        self.tokens = {name: f"token-{name}-{uuid.uuid4().hex[:12]}" for name in self.users}
        self.config = {
            "subnet": subnet,
            "run_id": uuid.uuid4().hex[:6],
            "images": dict(images),
            "nodes": nodes if nodes is not None else [{"name": "worker-1"}],
            "namespaces": list(namespaces),
            "tokens": {
                self.tokens[n]: {"user": u.name, "deny": u.deny} for n, u in self.users.items()
            },
            "protocols": list(protocols),
            "pod_quotas": dict(pod_quotas or {}),
        }
        self.context_namespace = context_namespace
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.bridge = ""
        self.kubeconfig = workdir / "kubeconfig"
        self.ca = b""

    def __enter__(self) -> FakeCluster:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self, timeout: float = 60.0) -> FakeCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cert, key, self.ca = _certificates(self.workdir)
        self.config.update(cert=str(cert), key=str(key), ready=str(self.workdir / "ready.json"))
        Path(self.config["ready"]).unlink(missing_ok=True)  # an earlier run's
        config = self.workdir / "config.json"
        config.write_text(json.dumps(self.config))
        log = (self.workdir / "server.log").open("ab")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.fakek8s", str(config)],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=env,
            start_new_session=True,
        )
        log.close()
        ready = Path(self.config["ready"])
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the Kubernetes stand-in did not start:\n{self.log_tail()}")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        self.port, self.bridge = info["port"], info["bridge"]
        self.write_kubeconfig(self.kubeconfig)
        return self

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def token(self, user: str = "alice") -> str:
        return self.tokens[user]

    def kubeconfig_body(self, user: str = "alice", context: str | None = None) -> dict[str, Any]:
        name = context or self.context
        ctx: dict[str, Any] = {"cluster": name, "user": f"{name}-{user}"}
        if self.context_namespace:
            ctx["namespace"] = self.context_namespace
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": name,
                    "cluster": {
                        "server": self.url,
                        "certificate-authority-data": base64.b64encode(self.ca).decode(),
                    },
                }
            ],
            "users": [{"name": f"{name}-{user}", "user": {"token": self.token(user)}}],
            "contexts": [{"name": name, "context": ctx}],
            "current-context": name,
        }

    def write_kubeconfig(self, path: Path, user: str = "alice") -> Path:
        path.write_text(json.dumps(self.kubeconfig_body(user)))
        path.chmod(0o600)
        return path

    # -- asking the cluster, as a client would -------------------------------------------------

    def request(
        self, method: str, path: str, body: Any = None, user: str = "alice"
    ) -> tuple[int, Any]:
        context = ssl.create_default_context(cadata=self.ca.decode())
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self.token(user)}",
                     "Content-Type": "application/json"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, context=context, timeout=30) as reply:
                return reply.status, json.loads(reply.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def pods(self, namespace: str = "default", selector: str = "") -> list[dict[str, Any]]:
        query = f"?labelSelector={urllib.parse.quote(selector)}" if selector else ""
        status, body = self.request("GET", f"/api/v1/namespaces/{namespace}/pods{query}")
        assert status == 200, body
        return list(body["items"])

    def services(self, namespace: str = "default", selector: str = "") -> list[dict[str, Any]]:
        query = f"?labelSelector={urllib.parse.quote(selector)}" if selector else ""
        status, body = self.request("GET", f"/api/v1/namespaces/{namespace}/services{query}")
        assert status == 200, body
        return list(body["items"])

    def create_pod(self, manifest: dict[str, Any], namespace: str = "default",
                   user: str = "alice") -> dict[str, Any]:  # fmt: skip
        status, body = self.request("POST", f"/api/v1/namespaces/{namespace}/pods", manifest, user)
        assert status == 201, body
        return dict(body)

    def wait_phase(self, name: str, phases: tuple[str, ...], namespace: str = "default",
                   timeout: float = 60) -> dict[str, Any]:  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            status, pod = self.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
            if status == 200 and pod["status"].get("phase") in phases:
                return dict(pod)
            if time.monotonic() > deadline:
                raise AssertionError(f"pod {name} not {phases} within {timeout}s: {pod}")
            time.sleep(0.2)

    def log_tail(self, size: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return (self.workdir / "server.log").read_text(errors="replace")[-size:]
        return ""

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None
        # What the server could not remove itself (killed): its owner record names it.
        from tests.support import bareroots

        bareroots.remove_stale_bare_resources()


def _certificates(folder: Path) -> tuple[Path, Path, bytes]:
    """A CA and a server certificate for 127.0.0.1 it signed; (cert, key, CA pem)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fake-kubernetes-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), True
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = folder / "server.crt", folder / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path, ca.public_bytes(serialization.Encoding.PEM)


# ================================================================== the server


def _selector_matches(selector: str, labels: Mapping[str, str]) -> bool:
    """A label selector as the API server reads it: ``k=v``, ``k==v``, ``k!=v``, ``k``,
    ``!k``, ``k in (a,b)``, ``k notin (a,b)``, comma-separated (all must hold)."""
    for term in re.findall(r"[^,(]+(?:\([^)]*\))?", selector):
        term = term.strip()
        if not term:
            continue
        if m := re.fullmatch(r"([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)", term):
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            if (labels.get(key) in values) != (op == "in"):
                return False
        elif "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = re.split("==?", term, maxsplit=1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def _field(obj: Mapping[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return "" if value is None else str(value)


def _fields_match(selector: str, obj: Mapping[str, Any]) -> bool:
    for term in filter(None, selector.split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if _field(obj, key) == value:
                return False
        else:
            key, value = re.split("==?", term, maxsplit=1)
            if _field(obj, key) != value:
                return False
    return True


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def _status_body(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}  # fmt: skip


class Server:
    """The API's state and its HTTP handlers (aiohttp), in the stand-in's own process."""

    def __init__(self, config: dict[str, Any]) -> None:
        from tests.support import bareroots, fakekubelet, sshd

        self.config = config
        self.tokens: dict[str, dict[str, Any]] = config["tokens"]
        self.namespaces = set(config["namespaces"])
        self.protocols = list(config["protocols"])
        self.pod_quotas: dict[str, int] = config.get("pod_quotas", {})
        self.nodes = [fakekubelet.Node(**n) for n in config["nodes"]]
        self.objects: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}  # (kind, ns) -> name
        self.events: dict[str, list[dict[str, Any]]] = {}  # ns -> events
        self.version = 1
        self.watchers: list[tuple[str, str, str, asyncio.Queue[Any]]] = []
        self.tasks: set[asyncio.Task[Any]] = set()
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{bareroots.BARE_NAME_PREFIX}k8s-"))
        self.net = sshd.NetnsHosts(0, subnet=config["subnet"], run_id=config["run_id"],
                                   start_sshd=False)  # fmt: skip
        self.net.build()
        self._owner = lambda: bareroots.write_owner(self.workdir, self.net)
        self._owner()
        self.kubelet = fakekubelet.Kubelet(
            net=self.net,
            workdir=self.workdir,
            images=config["images"],
            report=self.pod_changed,
            event=self.event,
            owner=self._owner,
            pull_seconds={n.name: n.pull_seconds for n in self.nodes},
        )
        self.schedule_wake = asyncio.Event()

    # -- bookkeeping ---------------------------------------------------------------------------

    def store(self, kind: str, namespace: str) -> dict[str, dict[str, Any]]:
        return self.objects.setdefault((kind, namespace), {})

    def publish(self, kind: str, obj: dict[str, Any], change: str) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        namespace = obj["metadata"].get("namespace", "")
        for w_kind, w_ns, selector, queue in list(self.watchers):
            if (
                w_kind == kind
                and w_ns == namespace
                and _selector_matches(selector, obj["metadata"].get("labels") or {})
            ):
                queue.put_nowait({"type": change, "object": json.loads(json.dumps(obj))})
        if kind == "pods":
            self.schedule_wake.set()

    def pod_changed(self, pod: dict[str, Any]) -> None:
        """The kubelet changed `pod`: publish it, and give its Service's pods its new name
        (a pod that got its IP is in every sibling's /etc/hosts, as DNS would answer at once)."""
        self.publish("pods", pod, "MODIFIED")
        self.refresh_hosts(pod["metadata"]["namespace"])

    def event(self, obj: dict[str, Any], kind: str, reason: str, message: str) -> None:
        meta = obj["metadata"]
        namespace = meta["namespace"]
        now = _now()
        events = self.events.setdefault(namespace, [])
        for old in events:
            same = old["involvedObject"]["uid"] == meta["uid"] and old["reason"] == reason
            if same and old["message"] == message:
                old["count"] += 1
                old["lastTimestamp"] = now
                return
        self.version += 1
        events.append({
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": namespace,
                         "resourceVersion": str(self.version), "creationTimestamp": now},
            "involvedObject": {"kind": "Pod", "namespace": namespace, "name": meta["name"],
                               "uid": meta["uid"], "apiVersion": "v1"},
            "reason": reason, "message": message, "type": kind, "count": 1,
            "firstTimestamp": now, "lastTimestamp": now,
            "source": {"component": "default-scheduler" if reason.endswith("Scheduling")
                       or reason == "Scheduled" else "kubelet"},
        })  # fmt: skip

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        task.add_done_callback(_report_failure)

    # -- who asks ------------------------------------------------------------------------------

    def user(self, request: Any) -> dict[str, Any]:
        header = request.headers.get("Authorization", "")
        token = header.removeprefix("Bearer ").strip()
        user = self.tokens.get(token) if header.startswith("Bearer ") else None
        if user is None:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        return user

    def allowed(self, user: Mapping[str, Any], verb: str, resource: str) -> bool:
        return f"{verb} {resource}" not in user["deny"]

    def authorize(self, user: Mapping[str, Any], verb: str, resource: str, namespace: str,
                  group: str = "") -> None:  # fmt: skip
        if self.allowed(user, verb, resource):
            return
        name, _, sub = resource.partition("/")
        what = f'resource "{name}"' + (f' in API group "{group}"')
        where = f' in the namespace "{namespace}"' if namespace else " at the cluster scope"
        shown = f"{name}/{sub}" if sub else name
        raise ApiError(
            403,
            "Forbidden",
            f'{shown} is forbidden: User "{user["user"]}" cannot {verb} '
            f"{what.replace(name, shown, 1)}{where}",
        )

    def namespace_exists(self, namespace: str) -> None:
        if namespace not in self.namespaces:
            raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found')

    # -- the scheduler -------------------------------------------------------------------------

    async def scheduler(self) -> None:
        from tests.support import fakekubelet

        while True:
            self.schedule_wake.clear()
            used: dict[str, int] = {}
            held: dict[str, int] = {}
            pending: list[dict[str, Any]] = []
            for (kind, _), pods in self.objects.items():
                if kind != "pods":
                    continue
                for pod in pods.values():
                    node = pod["spec"].get("nodeName")
                    if node and pod["status"].get("phase") in ("Pending", "Running"):
                        used[node] = used.get(node, 0) + fakekubelet.gpu_request(pod)
                        held[node] = held.get(node, 0) + 1
                    elif not node and not pod["metadata"].get("deletionTimestamp"):
                        pending.append(pod)
            for pod in sorted(pending, key=lambda p: p["metadata"]["creationTimestamp"]):
                try:
                    node = fakekubelet.schedule(pod, self.nodes, used, held)
                except ValueError as exc:
                    message = str(exc)
                    current = [c for c in pod["status"].get("conditions", [])
                               if c["type"] == "PodScheduled"]  # fmt: skip
                    if not current or current[0].get("message") != message:
                        fakekubelet.condition(pod, "PodScheduled", "False", "Unschedulable",
                                              message)  # fmt: skip
                        self.publish("pods", pod, "MODIFIED")
                    self.event(pod, "Warning", "FailedScheduling", message)
                    continue
                used[node] = used.get(node, 0) + fakekubelet.gpu_request(pod)
                held[node] = held.get(node, 0) + 1
                pod["spec"]["nodeName"] = node
                fakekubelet.condition(pod, "PodScheduled", "True")
                meta = pod["metadata"]
                self.event(
                    pod,
                    "Normal",
                    "Scheduled",
                    f"Successfully assigned {meta['namespace']}/{meta['name']} to {node}",
                )
                self.publish("pods", pod, "MODIFIED")
                self.spawn(self.kubelet.run(pod, lambda p=pod: self.hosts_of(p)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.schedule_wake.wait(), 1.0)

    def hosts_of(self, pod: Mapping[str, Any]) -> str:
        """The pod's /etc/hosts: its own name, and those of every pod of its headless Service
        (what the cluster's DNS would answer)."""
        meta, spec = pod["metadata"], pod["spec"]
        namespace = meta["namespace"]
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        hostname = spec.get("hostname") or meta["name"]
        subdomain = spec.get("subdomain")
        services = self.store("services", namespace)
        own_ip = pod["status"].get("podIP")
        if own_ip:
            full = f"{hostname}.{subdomain}.{namespace}.svc" if subdomain else ""
            names = f"{full}.cluster.local {full} {hostname}" if full else hostname
            lines.append(f"{own_ip}\t{names}")
        if subdomain and subdomain in services:
            for other in self.store("pods", namespace).values():
                ip = other["status"].get("podIP")
                o_spec = other["spec"]
                if other is pod or not ip or o_spec.get("subdomain") != subdomain:
                    continue
                name = f"{o_spec.get('hostname') or other['metadata']['name']}.{subdomain}"
                lines.append(f"{ip}\t{name}.{namespace}.svc.cluster.local {name}.{namespace}.svc")
        return "\n".join(lines) + "\n"

    def refresh_hosts(self, namespace: str) -> None:
        for pod in self.store("pods", namespace).values():
            self.kubelet.rewrite_hosts(pod["metadata"]["uid"], self.hosts_of(pod))

    # -- objects -------------------------------------------------------------------------------

    def create(self, kind: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self.namespace_exists(namespace)
        meta = body.setdefault("metadata", {})
        name = meta.get("name") or (meta.get("generateName", "") + uuid.uuid4().hex[:5])
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 63:
            raise ApiError(422, "Invalid", f'{kind[:-1].title()} "{name}" is invalid: '
                           "metadata.name: Invalid value")  # fmt: skip
        store = self.store(kind, namespace)
        if name in store:
            raise ApiError(409, "AlreadyExists", f'{kind} "{name}" already exists')
        limit = self.pod_quotas.get(namespace) if kind == "pods" else None
        if limit is not None:
            used = sum(p["status"].get("phase") in ("Pending", "Running") for p in store.values())
            if used >= limit:
                raise ApiError(
                    403,
                    "Forbidden",
                    f'pods "{name}" is forbidden: exceeded quota: pods-{namespace}, requested: '
                    f"pods=1, used: pods={used}, limited: pods={limit}",
                )
        meta.update(name=name, namespace=namespace, uid=str(uuid.uuid4()),
                    creationTimestamp=_now())  # fmt: skip
        if kind == "pods":
            body.setdefault("status", {})
            body["status"].update(phase="Pending", conditions=[], qosClass="BestEffort")
            body["spec"].setdefault("restartPolicy", "Always")
        if kind == "services":
            body.setdefault("spec", {}).setdefault("type", "ClusterIP")
            body["status"] = {"loadBalancer": {}}
        store[name] = body
        self.publish(kind, body, "ADDED")
        if kind == "services":
            self.refresh_hosts(namespace)
        return body

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any]:
        self.namespace_exists(namespace)
        found = self.store(kind, namespace).get(name)
        if found is None:
            raise ApiError(404, "NotFound", f'{kind} "{name}" not found')
        return found

    async def delete(self, kind: str, namespace: str, name: str, grace: float | None) -> Any:
        obj = self.get(kind, namespace, name)
        if kind == "services":
            del self.store(kind, namespace)[name]
            self.publish(kind, obj, "DELETED")
            self.refresh_hosts(namespace)
            return obj
        if grace is None:
            grace = float(obj["spec"].get("terminationGracePeriodSeconds", 30))
        if not obj["metadata"].get("deletionTimestamp"):
            obj["metadata"]["deletionTimestamp"] = _now()
            obj["metadata"]["deletionGracePeriodSeconds"] = int(grace)
            self.publish(kind, obj, "MODIFIED")
            self.spawn(self._finish_delete(obj, grace))
        return obj

    async def _finish_delete(self, pod: dict[str, Any], grace: float) -> None:
        await self.kubelet.stop(pod, grace)
        namespace, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        if self.store("pods", namespace).get(name) is pod:
            del self.store("pods", namespace)[name]
            self.publish("pods", pod, "DELETED")
            self.refresh_hosts(namespace)

    # -- HTTP ----------------------------------------------------------------------------------

    def app(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
            try:
                return await handler(request)
            except ApiError as exc:
                # The server's log says what it refused: a test's failure is read there.
                print(f"{request.method} {request.path}: {exc.code} {exc.message}", flush=True)
                return web.json_response(_status_body(exc.code, exc.reason, exc.message),
                                         status=exc.code)  # fmt: skip

        # Go's net/http reads a request line and headers of up to 1 MiB (DefaultMaxHeaderBytes).
        app = web.Application(
            middlewares=[errors],
            client_max_size=64 << 20,
            handler_args={"max_line_size": 1 << 20, "max_field_size": 1 << 20},
        )
        ns = "/api/v1/namespaces/{namespace}"
        app.router.add_get("/api/v1/namespaces/{namespace}", self.read_namespace)
        app.router.add_get("/api/v1/nodes", self.list_nodes)
        app.router.add_post(
            "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", self.access_review
        )
        for kind in ("pods", "services"):
            app.router.add_post(f"{ns}/{kind}", self.handle_create)
            app.router.add_get(f"{ns}/{kind}", self.handle_list)
            app.router.add_get(f"{ns}/{kind}/{{name}}", self.handle_get)
            app.router.add_delete(f"{ns}/{kind}/{{name}}", self.handle_delete)
        app.router.add_get(f"{ns}/events", self.list_events)
        app.router.add_get(f"{ns}/pods/{{name}}/log", self.pod_log)
        app.router.add_get(f"{ns}/pods/{{name}}/exec", self.pod_exec)
        app.router.add_post(f"{ns}/pods/{{name}}/exec", self.pod_exec)
        return app

    @staticmethod
    def kind_of(request: Any) -> str:
        return "pods" if "/pods" in request.path else "services"

    async def read_namespace(self, request: Any) -> Any:
        from aiohttp import web

        user = self.user(request)
        name = request.match_info["namespace"]
        self.authorize(user, "get", "namespaces", "")
        self.namespace_exists(name)
        return web.json_response(
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": name},
                "status": {"phase": "Active"},
            }
        )

    async def list_nodes(self, request: Any) -> Any:
        from aiohttp import web

        self.authorize(self.user(request), "list", "nodes", "")
        return web.json_response({"apiVersion": "v1", "kind": "NodeList", "metadata": {},
                                  "items": [n.manifest() for n in self.nodes]})  # fmt: skip

    async def access_review(self, request: Any) -> Any:
        from aiohttp import web

        user = self.user(request)
        body = await request.json()
        attrs = body["spec"].get("resourceAttributes") or {}
        resource = attrs.get("resource", "")
        if attrs.get("subresource"):
            resource += "/" + attrs["subresource"]
        allowed = self.allowed(user, attrs.get("verb", ""), resource)
        body["status"] = {"allowed": allowed, **({} if allowed else {"reason": "denied"})}
        return web.json_response(body, status=201)

    async def handle_create(self, request: Any) -> Any:
        from aiohttp import web

        kind, namespace = self.kind_of(request), request.match_info["namespace"]
        self.authorize(self.user(request), "create", kind, namespace)
        obj = self.create(kind, namespace, await request.json())
        return web.json_response(obj, status=201)

    async def handle_get(self, request: Any) -> Any:
        from aiohttp import web

        kind, namespace = self.kind_of(request), request.match_info["namespace"]
        self.authorize(self.user(request), "get", kind, namespace)
        return web.json_response(self.get(kind, namespace, request.match_info["name"]))

    async def handle_delete(self, request: Any) -> Any:
        from aiohttp import web

        kind, namespace = self.kind_of(request), request.match_info["namespace"]
        self.authorize(self.user(request), "delete", kind, namespace)
        grace: float | None = None
        if "gracePeriodSeconds" in request.query:
            grace = float(request.query["gracePeriodSeconds"])
        if request.can_read_body:
            with contextlib.suppress(ValueError):
                options = await request.json()
                if isinstance(options, dict) and options.get("gracePeriodSeconds") is not None:
                    grace = float(options["gracePeriodSeconds"])
        obj = await self.delete(kind, namespace, request.match_info["name"], grace)
        return web.json_response(obj)

    async def handle_list(self, request: Any) -> Any:
        from aiohttp import web

        kind, namespace = self.kind_of(request), request.match_info["namespace"]
        user = self.user(request)
        watching = request.query.get("watch") in ("true", "1", "True")
        self.authorize(user, "watch" if watching else "list", kind, namespace)
        self.namespace_exists(namespace)
        labels = request.query.get("labelSelector", "")
        fields = request.query.get("fieldSelector", "")

        def chosen() -> list[dict[str, Any]]:
            return [
                o for o in self.store(kind, namespace).values()
                if _selector_matches(labels, o["metadata"].get("labels") or {})
                and _fields_match(fields, o)
            ]  # fmt: skip

        if not watching:
            title = "PodList" if kind == "pods" else "ServiceList"
            return web.json_response({"apiVersion": "v1", "kind": title,
                                      "metadata": {"resourceVersion": str(self.version)},
                                      "items": chosen()})  # fmt: skip
        timeout = min(float(request.query.get("timeoutSeconds", WATCH_LIMIT)), WATCH_LIMIT)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        watcher = (kind, namespace, labels, queue)
        self.watchers.append(watcher)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        try:
            if not request.query.get("resourceVersion"):
                for obj in chosen():
                    await response.write(json.dumps({"type": "ADDED", "object": obj}).encode()
                                         + b"\n")  # fmt: skip
            deadline = time.monotonic() + timeout
            while (left := deadline - time.monotonic()) > 0:
                try:
                    event = await asyncio.wait_for(queue.get(), left)
                except TimeoutError:
                    break
                if _fields_match(fields, event["object"]):
                    await response.write(json.dumps(event).encode() + b"\n")
        except (ConnectionError, OSError):
            pass
        finally:
            self.watchers.remove(watcher)
        with contextlib.suppress(ConnectionError, OSError):
            await response.write_eof()
        return response

    async def list_events(self, request: Any) -> Any:
        from aiohttp import web

        namespace = request.match_info["namespace"]
        self.authorize(self.user(request), "list", "events", namespace)
        self.namespace_exists(namespace)
        fields = request.query.get("fieldSelector", "")
        items = [e for e in self.events.get(namespace, []) if _fields_match(fields, e)]
        return web.json_response({"apiVersion": "v1", "kind": "EventList",
                                  "metadata": {"resourceVersion": str(self.version)},
                                  "items": items})  # fmt: skip

    async def pod_log(self, request: Any) -> Any:
        from aiohttp import web

        namespace, name = request.match_info["namespace"], request.match_info["name"]
        self.authorize(self.user(request), "get", "pods/log", namespace)
        pod = self.get("pods", namespace, name)
        text = self.kubelet.log(pod["metadata"]["uid"]).decode(errors="replace")
        if "tailLines" in request.query:
            lines = text.splitlines(keepends=True)
            text = "".join(lines[-int(request.query["tailLines"]) :])
        return web.Response(text=text, content_type="text/plain")

    async def pod_exec(self, request: Any) -> Any:
        from aiohttp import web

        from tests.support import podruntime

        namespace, name = request.match_info["namespace"], request.match_info["name"]
        # A websocket's exec is a GET, which RBAC reads as `get pods/exec`; 1.35 and later
        # ask `create` of it too (as of the older SPDY POST): both, here.
        user = self.user(request)
        if request.method == "GET":
            self.authorize(user, "get", "pods/exec", namespace)
        self.authorize(user, "create", "pods/exec", namespace)
        pod = self.get("pods", namespace, name)
        container = self.kubelet.container(pod["metadata"]["uid"])
        if container is None or not container.running:
            raise ApiError(400, "BadRequest", f"container node is not valid for pod {name}")
        argv = request.query.getall("command", [])
        offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")]
        protocols = [p for p in self.protocols if p in offered]
        if not protocols:
            raise ApiError(400, "BadRequest", "no supported exec subprotocol was offered")
        ws = web.WebSocketResponse(protocols=protocols, max_msg_size=0, autoping=True)
        await ws.prepare(request)
        v5 = ws.ws_protocol == V5
        try:
            path = container.env.get("PATH", "/usr/bin:/bin")
            podruntime.find_executable(Path(f"/proc/{container.pid}/root"), argv[0], path)
        except (OSError, IndexError) as exc:
            message = (
                "OCI runtime exec failed: exec failed: unable to start container process: "
                f"{exc}: unknown"
            )
            await ws.send_bytes(b"\x03" + json.dumps(
                {"metadata": {}, "status": "Failure", "message": message,
                 "reason": "InternalError", "code": 500}).encode())  # fmt: skip
            await ws.close()
            return ws
        process = await asyncio.create_subprocess_exec(
            *podruntime.exec_argv(container, argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=container.env,
            start_new_session=True,
        )
        assert process.stdin and process.stdout and process.stderr
        stdin = process.stdin
        send_lock = asyncio.Lock()

        async def relay(stream: asyncio.StreamReader, channel: int) -> None:
            prefix = bytes([channel])
            while chunk := await stream.read(1 << 16):
                async with send_lock:
                    with contextlib.suppress(ConnectionError, RuntimeError):
                        await ws.send_bytes(prefix + chunk)

        async def take() -> None:
            from aiohttp import WSMsgType

            try:
                async for msg in ws:
                    if msg.type != WSMsgType.BINARY or not msg.data:
                        continue
                    data: bytes = msg.data
                    if data[0] == 0 and len(data) > 1:
                        stdin.write(data[1:])
                        await stdin.drain()
                    elif v5 and data[0] == 255 and data[1:2] == b"\x00":
                        stdin.close()
            except (ConnectionError, BrokenPipeError):
                pass
            finally:
                # The stream's end closes the command's stdin, as the kubelet does.
                with contextlib.suppress(Exception):
                    stdin.close()

        taker = asyncio.get_running_loop().create_task(take())
        await asyncio.gather(relay(process.stdout, 1), relay(process.stderr, 2))
        code = await process.wait()
        code = podruntime.exit_code(code)
        if code == 0:
            status: dict[str, Any] = {"metadata": {}, "status": "Success"}
        else:
            status = {
                "metadata": {}, "status": "Failure",
                "message": f"command terminated with non-zero exit code: exit status {code}",
                "reason": "NonZeroExitCode",
                "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]},
            }  # fmt: skip
        async with send_lock:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await ws.send_bytes(b"\x03" + json.dumps(status).encode())
        with contextlib.suppress(Exception):
            await ws.close()
        taker.cancel()
        with contextlib.suppress(BaseException):
            await taker
        return ws

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await self.kubelet.close()
        self.net.close(raise_on_leftovers=False)
        from tests.support import bareroots

        bareroots._remove_tree(self.workdir)


def _report_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        print(f"task failed: {task.exception()!r}", flush=True)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def _serve(config: dict[str, Any]) -> None:
    from aiohttp import web

    server = Server(config)
    try:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(config["cert"], config["key"])
        runner = web.AppRunner(server.app(), handle_signals=False, shutdown_timeout=1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
        await site.start()
        port = runner.addresses[0][1]
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        scheduler = loop.create_task(server.scheduler())
        ready = Path(config["ready"])
        partial = ready.with_suffix(".partial")
        partial.write_text(json.dumps({"port": port, "bridge": server.net.bridge_address}))
        partial.replace(ready)
        await stop.wait()
        scheduler.cancel()
        await runner.cleanup()
    finally:
        await server.close()


def main(argv: list[str]) -> int:
    config = json.loads(Path(argv[1]).read_text())
    asyncio.run(_serve(config))
    return 0


@contextlib.contextmanager
def running(workdir: Path, **kwargs: Any) -> Iterator[FakeCluster]:
    cluster = FakeCluster(workdir, **kwargs).start()
    try:
        yield cluster
    finally:
        cluster.stop()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
