"""The Kubernetes deployment in deploy/k8s, checked offline (no cluster, no network).

Every manifest is validated against the Kubernetes OpenAPI schemas that the
``kubernetes-validate`` package ships (strict: unknown fields fail), and the
things loaderd depends on are asserted: the ConfigMap's ds.yaml parses with
loaderd's own parser, one port everywhere, a grace period that covers the
drain, a sized memory-backed /dev/shm, non-root with a read-only root.
"""

from __future__ import annotations

import ast
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from loaderd.server.config import ConfigError, LoaderConfig, load_config

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "k8s"
# Validated against the oldest Kubernetes these manifests need (native gRPC probes
# are GA in 1.27) and a current one; both ship inside kubernetes-validate.
KUBERNETES_VERSIONS = ("1.27.0", "1.33.0")
SERVICE_NAME = "loaderd.v1.Loader"
# SIGTERM -> drain (at most drain_timeout) -> shutdown: stopping the gRPC server,
# the workers and the fork server and unlinking shared memory takes up to ~10 s.
SHUTDOWN_MARGIN_S = 10


def manifest_files() -> list[Path]:
    """The files kubectl applies: every YAML file except kustomize's own."""
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def load_docs() -> list[dict[str, Any]]:
    docs = []
    for path in manifest_files():
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def one(kind: str) -> dict[str, Any]:
    found = [d for d in load_docs() if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in deploy/k8s, found {len(found)}"
    return found[0]


def container() -> dict[str, Any]:
    containers = one("Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def pod_spec() -> dict[str, Any]:
    return one("Deployment")["spec"]["template"]["spec"]


def raw_ds_yaml() -> dict[str, Any]:
    return yaml.safe_load(one("ConfigMap")["data"]["ds.yaml"])


def loaded_config(tmp_path: Path) -> tuple[LoaderConfig, dict[str, Any]]:
    """ds.yaml from the ConfigMap through loaderd's own load_config (which imports nothing).

    Written where the pod mounts it, relative to tmp_path, so relative python_path
    entries would resolve as in the pod. If this checkout's parser does not know
    ``drain_timeout`` yet, the key is stripped before parsing (it is checked from
    the raw YAML instead).
    """
    raw = raw_ds_yaml()
    path = tmp_path / "ds.yaml"
    path.write_text(one("ConfigMap")["data"]["ds.yaml"])
    try:
        return load_config(path), raw
    except ConfigError as exc:
        if "'drain_timeout'" not in str(exc) or "unknown key" not in str(exc):
            raise
    stripped = {k: v for k, v in raw.items() if k != "drain_timeout"}
    path.write_text(yaml.safe_dump(stripped))
    return load_config(path), raw


_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_DECIMAL = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity_bytes(value: str | int) -> int:
    """A Kubernetes memory quantity ("1280Mi", "6Gi", "512M", 1024) in bytes."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T|)", str(value))
    assert m, f"unsupported quantity {value!r}"
    return int(m.group(1)) * {**_BINARY, **_DECIMAL}[m.group(2)]


def listen_port(config: LoaderConfig) -> int:
    ports = {int(a.rsplit(":", 1)[1]) for a in config.listen if not a.startswith("unix:")}
    assert len(ports) == 1, f"expected one TCP listen port, got {config.listen}"
    return ports.pop()


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any attempt to resolve a name or open a connection fails the test."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"network access during schema validation: {args!r}")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    yield


@pytest.mark.timeout(10)
def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [p.name for p in manifest_files()]
    kinds = sorted(d["kind"] for d in load_docs())
    assert kinds == ["ConfigMap", "Deployment", "PodDisruptionBudget", "Service"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("k8s_version", KUBERNETES_VERSIONS)
def test_manifests_match_kubernetes_schemas_offline(k8s_version: str, no_network: None) -> None:
    import kubernetes_validate

    for doc in load_docs():
        # Raises ValidationError (a field of the wrong type, a misspelled or unknown
        # field: strict) or SchemaNotFoundError (a kind/apiVersion it does not know).
        validated = kubernetes_validate.validate(doc, k8s_version, strict=True)
        assert validated == k8s_version.rsplit(".", 1)[0], f"{doc['kind']} validated against {validated}"


@pytest.mark.timeout(30)
def test_schema_validation_catches_mistakes(no_network: None) -> None:
    """The validator is not a no-op: a misspelled field and a wrong type both fail."""
    import kubernetes_validate

    deployment = one("Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 7070}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)
    service = one("Service")
    service["spec"]["ports"][0]["port"] = "seventy"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.timeout(10)
def test_config_parses_with_loaderds_parser(tmp_path: Path) -> None:
    config, raw = loaded_config(tmp_path)
    assert config.listen == ("0.0.0.0:7070",), "TCP on every pod address, no unix socket in a pod"
    drain = raw.get("drain_timeout")
    assert isinstance(drain, (int, float)) and drain > 0, "ds.yaml must set drain_timeout"
    if hasattr(config, "drain_timeout"):
        assert config.drain_timeout == drain

    # The config file and python_path are where the pod mounts the ConfigMap.
    mount = next(m for m in container()["volumeMounts"] if m["name"] == "config")
    assert container()["command"][container()["command"].index("--config") + 1] == f"{mount['mountPath']}/ds.yaml"
    volume = next(v for v in pod_spec()["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == one("ConfigMap")["metadata"]["name"]
    assert config.python_path == (mount["mountPath"],)

    # The example datasets ride in the ConfigMap: the same file as deploy/example_datasets.py,
    # defining what ds.yaml names (checked without importing it).
    data = one("ConfigMap")["data"]
    assert data["example_datasets.py"] == (REPO / "deploy" / "example_datasets.py").read_text()
    for spec in config.datasets.values():
        module, _, attr = spec.factory.partition(":")
        source = data[f"{module}.py"]
        defined = {n.name for n in ast.parse(source).body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
        assert attr in defined, f"{spec.factory} is not defined in the ConfigMap's {module}.py"


@pytest.mark.timeout(10)
def test_one_port_everywhere(tmp_path: Path) -> None:
    config, _ = loaded_config(tmp_path)
    port = listen_port(config)
    assert port == 7070

    (container_port,) = container()["ports"]
    assert container_port == {"name": "grpc", "containerPort": port, "protocol": "TCP"}

    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        spec = container()[probe]
        assert set(spec) & {"grpc", "tcpSocket", "httpGet", "exec"} == {"grpc"}, f"{probe} must be a native gRPC probe"
        assert spec["grpc"]["port"] == port, probe
        assert spec["grpc"].get("service", "") in ("", SERVICE_NAME), probe

    (service_port,) = one("Service")["spec"]["ports"]
    assert service_port["name"] == "grpc"
    # Clients dial the pod IPs from DNS, so the Service port must be the port the daemon serves.
    assert service_port["port"] == port
    assert service_port["targetPort"] in (port, container_port["name"])


@pytest.mark.timeout(10)
def test_grace_period_covers_the_drain(tmp_path: Path) -> None:
    _, raw = loaded_config(tmp_path)
    drain = raw["drain_timeout"]
    grace = pod_spec()["terminationGracePeriodSeconds"]
    assert grace > drain
    assert grace >= drain + SHUTDOWN_MARGIN_S, "the drain, then the shutdown, before SIGKILL"

    # A draining daemon says NOT_SERVING: its liveness probe must not kill it mid-drain.
    liveness = container()["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > grace

    # The startup probe waits at least as long as the daemon gives its workers to build datasets.
    command = container()["command"]
    startup_timeout = float(command[command.index("--startup-timeout") + 1])
    startup = container()["startupProbe"]
    assert startup.get("initialDelaySeconds", 0) + startup["periodSeconds"] * startup["failureThreshold"] >= startup_timeout


@pytest.mark.timeout(10)
def test_dev_shm_is_sized_memory(tmp_path: Path) -> None:
    config, _ = loaded_config(tmp_path)
    mounts = {m["mountPath"]: m for m in container()["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}

    shm = volumes[mounts["/dev/shm"]["name"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    size = quantity_bytes(shm["sizeLimit"])
    # Every worker may fill shm_bytes_per_worker with batches: that must fit.
    assert size >= config.workers * config.shm_bytes_per_worker > 0
    # Memory-backed emptyDir counts against the container's memory limit.
    limits = container()["resources"]["limits"]
    assert quantity_bytes(limits["memory"]) > size

    # The read-only root needs a writable /tmp (the fork server's socket).
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    assert not mounts["/tmp"].get("readOnly", False)


@pytest.mark.timeout(10)
def test_locked_down() -> None:
    pod = pod_spec()["securityContext"]
    ctr = container()["securityContext"]
    assert pod["runAsNonRoot"] is True and ctr["runAsNonRoot"] is True
    assert pod["runAsUser"] > 0 and ctr["runAsUser"] > 0
    assert ctr["readOnlyRootFilesystem"] is True
    assert ctr["allowPrivilegeEscalation"] is False
    assert ctr["capabilities"]["drop"] == ["ALL"] and not ctr["capabilities"].get("add")
    assert pod["seccompProfile"]["type"] == "RuntimeDefault"
    assert ctr.get("seccompProfile", pod["seccompProfile"])["type"] == "RuntimeDefault"
    resources = container()["resources"]
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(resources[kind]), f"resources.{kind} needs cpu and memory"


@pytest.mark.timeout(10)
def test_headless_service_and_rolling_update() -> None:
    deployment = one("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    service = one("Service")["spec"]
    assert service["clusterIP"] == "None"
    assert service["publishNotReadyAddresses"] is False, "starting and draining daemons stay out of DNS"
    assert service["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels.items()

    strategy = deployment["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
