"""The Kubernetes deployment in deploy/k8s, checked offline (no cluster, no network).

Every manifest is validated against the Kubernetes OpenAPI schemas that the
``kubernetes-validate`` package ships (strict: unknown fields fail), and the
things loaderd depends on are asserted: the ConfigMap's ds.yaml parses with
loaderd's own parser, ports that agree everywhere (TLS for clients, plaintext
for the kubelet's probes only), TLS files and tokens from read-only Secrets, a
NetworkPolicy that admits clients and Prometheus only, a grace period that
covers the drain, a sized memory-backed /dev/shm, non-root with a read-only root.
The Secret template (secrets.example.yaml) is validated too, but kustomize does
not apply it.
"""

from __future__ import annotations

import ast
import re
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.deploy_configs import Listener, check_contract, parse_with_loaderd

from loaderd.server.config.schema import LoaderConfig

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
# Validated against the oldest Kubernetes these manifests need (native gRPC probes
# are GA in 1.27) and a current one; both ship inside kubernetes-validate.
KUBERNETES_VERSIONS = ("1.27.0", "1.33.0")
SERVICE_NAME = "loaderd.v1.Loader"
# SIGTERM -> drain (at most drain_timeout) -> shutdown: stopping the gRPC server,
# the workers and the fork server and unlinking shared memory takes up to ~10 s.
SHUTDOWN_MARGIN_S = 10


def manifest_files() -> list[Path]:
    """The files kubectl applies: every YAML file except kustomize's own and the templates."""
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml" and not p.name.endswith(".example.yaml"))


def template_files() -> list[Path]:
    """Templates with placeholders (the Secrets): validated, never applied by kustomize."""
    return sorted(K8S.glob("*.example.yaml"))


def load_docs(paths: list[Path] | None = None) -> list[dict[str, Any]]:
    docs = []
    for path in manifest_files() if paths is None else paths:
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def secrets_by_name() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in load_docs(template_files()) if d["kind"] == "Secret"}


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

    Written to tmp_path/ds.yaml; python_path is absolute, so it resolves as in the
    pod. The listen/auth/metrics format is checked by ``deploy_configs`` (see
    there for a parser that predates it).
    """
    text = one("ConfigMap")["data"]["ds.yaml"]
    return parse_with_loaderd(text, tmp_path / "ds.yaml", tmp_path / "files"), raw_ds_yaml()


_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_DECIMAL = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity_bytes(value: str | int) -> int:
    """A Kubernetes memory quantity ("1280Mi", "6Gi", "512M", 1024) in bytes."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T|)", str(value))
    assert m, f"unsupported quantity {value!r}"
    return int(m.group(1)) * {**_BINARY, **_DECIMAL}[m.group(2)]


def listeners() -> tuple[Listener, Listener]:
    """ds.yaml's two listeners: (TLS for clients, plaintext for the kubelet's probes)."""
    found = check_contract(raw_ds_yaml())
    assert not any(lst.unix for lst in found), "no unix socket in a pod: nothing on its disk is shared"
    tls = [lst for lst in found if lst.tls]
    plain = [lst for lst in found if not lst.tls]
    assert len(tls) == 1 and len(plain) == 1, f"expected one TLS and one plaintext listener, got {found}"
    assert plain[0].insecure, "the probe listener is plaintext on the pod address: it must say insecure: true"
    return tls[0], plain[0]


def named_port(name: str) -> dict[str, Any]:
    (port,) = [p for p in container()["ports"] if p["name"] == name]
    return port


def volume_for(mount_path_prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(volumeMount, volume) of the mount that holds ``mount_path_prefix``'s files."""
    mounts = [m for m in container()["volumeMounts"] if mount_path_prefix.startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(mounts) == 1, f"{mount_path_prefix} should be in exactly one mount, got {mounts}"
    volume = next(v for v in pod_spec()["volumes"] if v["name"] == mounts[0]["name"])
    return mounts[0], volume


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
    assert kinds == ["ConfigMap", "Deployment", "NetworkPolicy", "PodDisruptionBudget", "Service"]
    # The Secrets are created with kubectl; applying the template would overwrite them with placeholders.
    assert [p.name for p in template_files()] == ["secrets.example.yaml"]
    assert sorted(d["kind"] for d in load_docs(template_files())) == ["Secret", "Secret"]
    assert "secrets.example.yaml" not in kustomization["resources"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("k8s_version", KUBERNETES_VERSIONS)
def test_manifests_match_kubernetes_schemas_offline(k8s_version: str, no_network: None) -> None:
    import kubernetes_validate

    for doc in load_docs(manifest_files() + template_files()):
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
    policy = one("NetworkPolicy")
    policy["spec"]["ingres"] = policy["spec"].pop("ingress")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(policy, KUBERNETES_VERSIONS[-1], strict=True)
    secret = secrets_by_name()["loaderd-tokens"]
    secret["stringData"]["tokens.txt"] = ["not", "a", "string"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(secret, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.timeout(10)
def test_config_parses_with_loaderds_parser(tmp_path: Path) -> None:
    config, raw = loaded_config(tmp_path)
    tls, probe = listeners()
    assert tls.address == "0.0.0.0:7070" and probe.address == "0.0.0.0:7071", "every pod address"
    assert raw["auth"]["token_file"], "tokens: the probe listener is plaintext, so only health may answer without one"
    drain = raw.get("drain_timeout")
    assert isinstance(drain, (int, float)) and drain > 0, "ds.yaml must set drain_timeout"
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
def test_ports_agree_everywhere(tmp_path: Path) -> None:
    loaded_config(tmp_path)
    tls, probe = listeners()
    assert tls.port == 7070 and probe.port == 7071

    assert sorted(p["name"] for p in container()["ports"]) == ["grpc", "metrics", "probe"]
    grpc_port = named_port("grpc")
    assert grpc_port == {"name": "grpc", "containerPort": tls.port, "protocol": "TCP"}
    assert named_port("probe") == {"name": "probe", "containerPort": probe.port, "protocol": "TCP"}
    metrics = raw_ds_yaml()["metrics"]
    assert named_port("metrics") == {"name": "metrics", "containerPort": metrics["port"], "protocol": "TCP"}
    assert metrics["require_token"] is True, "the metrics endpoint names clients and datasets"

    # Native gRPC probes cannot speak TLS: they use the plaintext listener.
    for name in ("startupProbe", "readinessProbe", "livenessProbe"):
        spec = container()[name]
        assert set(spec) & {"grpc", "tcpSocket", "httpGet", "exec"} == {"grpc"}, f"{name} must be a native gRPC probe"
        assert spec["grpc"]["port"] == probe.port, name
        assert spec["grpc"].get("service", "") in ("", SERVICE_NAME), name

    # Clients dial the pod IPs from DNS, so the Service port must be the TLS port the daemon
    # serves; the probe and metrics ports stay out of the Service.
    (service_port,) = one("Service")["spec"]["ports"]
    assert service_port["name"] == "grpc"
    assert service_port["port"] == tls.port
    assert service_port["targetPort"] in (tls.port, grpc_port["name"])


@pytest.mark.timeout(10)
def test_tls_and_tokens_come_from_read_only_secrets() -> None:
    tls, _ = listeners()
    assert tls.tls is not None
    token_file = raw_ds_yaml()["auth"]["token_file"]
    templates = secrets_by_name()
    fs_group = pod_spec()["securityContext"]["fsGroup"]
    assert fs_group == pod_spec()["securityContext"]["runAsGroup"], "the daemon reads the secrets through its group"

    wanted = {name: path for name, path in tls.tls.items()} | {"token_file": token_file}
    for what, path in wanted.items():
        mount, volume = volume_for(path)
        assert mount["readOnly"] is True, f"{what}: {path} must be on a read-only mount"
        assert "secret" in volume, f"{what}: {path} must come from a Secret"
        secret = volume["secret"]
        template = templates[secret["secretName"]]
        key = path[len(mount["mountPath"].rstrip("/")) + 1 :]
        if "items" in secret:
            key = next(item["key"] for item in secret["items"] if item["path"] == key)
        assert key in template["stringData"], f"{what}: the Secret {secret['secretName']} has no key {key}"
        # Kubernetes writes Secret files owned by root, group fsGroup, with these bits; the
        # daemon refuses a token file that others can read or the group can write, and
        # accepts group read only on a file root owns.
        mode = secret["defaultMode"]
        assert not mode & 0o007, f"{what}: defaultMode {mode:o} lets every user in"
        assert not mode & stat.S_IWGRP and mode & stat.S_IRGRP, f"{what}: defaultMode {mode:o}: the daemon reads through fsGroup"
        assert secret.get("optional", False) is False, f"{what}: a missing Secret must stop the pod, not start it without TLS"

    assert templates["loaderd-tls"]["type"] == "kubernetes.io/tls"
    assert {"tls.crt", "tls.key"} <= set(templates["loaderd-tls"]["stringData"])
    assert templates["loaderd-tokens"]["type"] == "Opaque"


@pytest.mark.timeout(10)
def test_secret_template_holds_no_usable_secret() -> None:
    """Placeholders only: no key material, and no token line a daemon would accept."""
    text = (K8S / "secrets.example.yaml").read_text()
    assert "-----BEGIN" not in text
    templates = secrets_by_name()
    for value in templates["loaderd-tls"]["stringData"].values():
        assert value.startswith("REPLACE"), value
    lines = [line.strip() for line in templates["loaderd-tokens"]["stringData"]["tokens.txt"].splitlines()]
    assert all(not line or line.startswith("#") for line in lines), "every token line stays commented out"


@pytest.mark.timeout(10)
def test_network_policy_admits_clients_and_prometheus_only() -> None:
    tls, _probe = listeners()
    metrics_port = raw_ds_yaml()["metrics"]["port"]
    policy = one("NetworkPolicy")["spec"]
    labels = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert sorted(policy["policyTypes"]) == ["Egress", "Ingress"]

    admitted: dict[int, list[dict[str, Any]]] = {}
    for rule in policy["ingress"]:
        assert rule.get("from"), "every ingress rule names who (no rule open to all)"
        for port in rule["ports"]:
            assert port["protocol"] == "TCP"
            admitted.setdefault(port["port"], []).extend(rule["from"])
    assert sorted(admitted) == sorted([tls.port, metrics_port]), "the probe port is for the kubelet only"
    assert admitted[tls.port] == [{"podSelector": {"matchLabels": {"loaderd-client": "true"}}}]
    (monitoring,) = admitted[metrics_port]
    assert set(monitoring) == {"namespaceSelector", "podSelector"}, "Prometheus: a namespace and its pods, both"

    # Out: DNS only.
    ports = [(p["port"], p["protocol"]) for rule in policy["egress"] for p in rule["ports"]]
    assert sorted(ports) == [(53, "TCP"), (53, "UDP")]
    assert all(rule.get("to") for rule in policy["egress"]), "DNS: the cluster's DNS pods, not anywhere"


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


# ------------------------------------------------------------------ autoscaling the daemons (deploy/k8s/autoscaling)

AUTOSCALING = K8S / "autoscaling"


def exported_metrics() -> set[str]:
    """The names a daemon's metrics endpoint exports, as Prometheus sees them (counters with _total)."""
    from loaderd.server.ops.metrics import _StatusCollector
    from loaderd.v1 import loaderd_pb2 as pb

    names = set()
    for family in _StatusCollector(lambda: pb.StatusResponse()).collect():
        names |= {sample.name for sample in family.samples} | {f"{family.name}_total" if family.type == "counter" else family.name}
    return names


@pytest.mark.timeout(30)
@pytest.mark.parametrize("k8s_version", KUBERNETES_VERSIONS)
def test_autoscaling_manifests_match_kubernetes_schemas_offline(k8s_version: str, no_network: None) -> None:
    import kubernetes_validate

    for path in (AUTOSCALING / "hpa.yaml", AUTOSCALING / "prometheus-adapter-rules.yaml"):
        for doc in load_docs([path]):
            assert kubernetes_validate.validate(doc, k8s_version, strict=True) == k8s_version.rsplit(".", 1)[0]


@pytest.mark.timeout(30)
def test_the_autoscalers_scale_the_deployment_on_a_metric_the_daemons_export(tmp_path: Path) -> None:
    (hpa,) = load_docs([AUTOSCALING / "hpa.yaml"])
    (adapter,) = load_docs([AUTOSCALING / "prometheus-adapter-rules.yaml"])
    (keda,) = load_docs([AUTOSCALING / "keda-scaledobject.yaml"])
    deployment = one("Deployment")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"], target["apiVersion"]) == ("Deployment", deployment["metadata"]["name"], deployment["apiVersion"])
    assert keda["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    # The adapter turns the daemons' counter into the per-pod metric the HPA names.
    (rule,) = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    counter = rule["seriesQuery"].split("{", 1)[0]
    assert counter == "loaderd_pool_limited_seconds_total" and counter in exported_metrics()
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    assert "rate(" in rule["metricsQuery"]
    # KEDA asks Prometheus for the same rate, with the same target per daemon.
    (trigger,) = keda["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and f"rate({counter}" in trigger["metadata"]["query"]
    assert float(trigger["metadata"]["threshold"]) == quantity_bytes(metric["pods"]["target"]["averageValue"].rstrip("m")) / 1000
    assert keda["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["spec"]["behavior"]
    # A daemon scaled down drains first: scale-downs are spaced wider than its drain.
    config, _ = loaded_config(tmp_path)
    down = hpa["spec"]["behavior"]["scaleDown"]
    assert min(p["periodSeconds"] for p in down["policies"]) > config.drain_timeout
    assert hpa["spec"]["minReplicas"] >= 2, "the PodDisruptionBudget lets one daemon go while a node drains"
