"""deploy/systemd and deploy/container, checked offline: no systemd, no Docker daemon needed.

The unit is parsed and its settings asserted; where ``systemd-analyze`` exists,
``systemd-analyze verify`` must find nothing to say about it (it exits 0 even for
unknown keys, so its output is what counts). The Dockerfile is parsed and its
instructions, base image, user, health check and pins asserted; the image itself
is not built here. Both example configs follow the config format (tests/support/deploy_configs.py).
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from support.deploy_configs import Listener, check_contract, parse_with_loaderd

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
SYSTEMD = REPO / "deploy" / "systemd"
CONTAINER = REPO / "deploy" / "container"
UNIT = SYSTEMD / "loaderd.service"
DOCKERFILE = CONTAINER / "Dockerfile"
# SIGTERM -> drain (at most drain_timeout) -> shutdown, which takes up to ~10 s
# (stop the gRPC server, workers and fork server, unlink shared memory); then margin.
SHUTDOWN_MARGIN_S = 10
# `loaderd serve --startup-timeout` default (server/app/cli.py): seconds workers get to build datasets.
DEFAULT_STARTUP_TIMEOUT_S = 600
CONFIG_PATH = "/etc/loaderd/loaderd.yaml"
COMMAND_TIMEOUT_S = 30
# Two groups: the daemon's own (its config, TLS key and token file are root:loaderd 0640;
# no member but the daemon) and the unix socket's, which clients join.
DAEMON_GROUP = "loaderd"
CLIENT_GROUP = "loaderd-clients"
# The container image's fixed gids (client containers: docker run --group-add 10002).
DAEMON_GID = 10001
CLIENT_GID = 10002

# ---------------------------------------------------------------- systemd


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values in order]}} (systemd allows a key more than once)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    pending = ""
    for number, raw in enumerate(text.splitlines(), 1):
        line = pending + raw.strip()
        pending = ""
        if not line or line.startswith(("#", ";")):
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("["):
            assert line.endswith("]"), f"line {number}: bad section header {line!r}"
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"line {number}: a setting before any section"
        key, sep, value = line.partition("=")
        assert sep, f"line {number}: not KEY=VALUE: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def service() -> dict[str, list[str]]:
    return parse_unit(UNIT.read_text())["Service"]


def setting(key: str) -> str:
    values = service()[key]
    assert len(values) == 1, f"{key} is set {len(values)} times"
    return values[0]


def supplementary_groups() -> list[str]:
    """SupplementaryGroups= (space-separated, may be given more than once; an empty one resets)."""
    groups: list[str] = []
    for value in service().get("SupplementaryGroups", []):
        groups = groups + value.split() if value else []
    return groups


def seconds(value: str) -> float:
    """A systemd time span ("60", "60s", "1min 30s", "2m") in seconds."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "ms": 1e-3}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * units[unit]
    assert total > 0, f"not a time span: {value!r}"
    return total


def systemd_config() -> dict:
    return yaml.safe_load((SYSTEMD / "loaderd.yaml").read_text())


def uncommented(text: str) -> str:
    """The config with its commented-out listener and auth examples switched on."""
    pattern = re.compile(r"^(\s*)# (- address: .*|  tls: .*|auth:|  token_file: .*)$")
    return "\n".join(pattern.sub(r"\1\2", line) for line in text.splitlines()) + "\n"


def test_unit_sections_and_notify() -> None:
    unit = parse_unit(UNIT.read_text())
    assert set(unit) == {"Unit", "Service", "Install"}
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    assert setting("Type") == "notify", "READY=1 from the daemon once it serves"
    assert setting("NotifyAccess") == "main", "workers inherit $NOTIFY_SOCKET; only the daemon counts"
    assert seconds(setting("WatchdogSec")) == 30
    assert shlex.split(setting("ExecStart")) == ["/usr/local/bin/loaderd", "serve", "--config", CONFIG_PATH]


def test_unit_stops_by_draining() -> None:
    assert setting("KillSignal") == "SIGTERM", "SIGTERM drains"
    assert setting("KillMode") == "mixed", "SIGTERM to the daemon only: it stops its workers after the drain"
    drain = systemd_config()["drain_timeout"]
    assert seconds(setting("TimeoutStopSec")) >= drain + SHUTDOWN_MARGIN_S + 5, "the drain, the shutdown, then a margin"
    assert seconds(setting("TimeoutStartSec")) > DEFAULT_STARTUP_TIMEOUT_S, "the daemon's own startup timeout fires first"
    assert setting("Restart") == "on-failure"
    assert setting("RestartPreventExitStatus") == "2", "a config error is not retried"


def test_unit_user_socket_and_limits() -> None:
    assert setting("User") == "loaderd" and setting("Group") == DAEMON_GROUP
    assert "DynamicUser" not in service(), "root:loaderd files and the clients' group need static groups"
    # The daemon chowns its socket to the clients' group: without CAP_CHOWN it must be a member.
    assert CLIENT_GROUP in supplementary_groups(), "SupplementaryGroups= must include the socket's group"
    assert DAEMON_GROUP not in supplementary_groups()
    assert setting("RuntimeDirectory") == "loaderd"
    # Owned loaderd:loaderd (the unit's Group=, which clients must not join): clients enter
    # it as "others"; the socket in it is 0660 group loaderd-clients.
    mode = int(setting("RuntimeDirectoryMode"), 8)
    assert mode & 0o001, "socket clients (not in the loaderd group) must be able to enter /run/loaderd"
    assert not mode & 0o022, "only the daemon creates or removes files in /run/loaderd"
    assert setting("UMask") == "0077"
    assert int(setting("LimitNOFILE")) >= 65536
    sysusers = (SYSTEMD / "loaderd.sysusers").read_text()
    assert re.search(r"^u loaderd ", sysusers, re.M), "the user the unit names is created"
    assert re.search(rf"^g {CLIENT_GROUP} ", sysusers, re.M), "the clients' group the unit names is created"
    # Nobody, not even the daemon, is made a member of its own group by the sysusers file.
    assert not re.search(rf"^m \S+ {DAEMON_GROUP}\s*$", sysusers, re.M), "the loaderd group has no members"


HARDENING = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "read-only",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectControlGroups": "yes",
    "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
    "RestrictNamespaces": "yes",
    "RestrictRealtime": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
    "SystemCallArchitectures": "native",
    "CapabilityBoundingSet": "",
}


def test_unit_hardening() -> None:
    for key, value in HARDENING.items():
        assert setting(key) == value, key
    # /dev/shm must stay the host's: clients map the workers' segments from there. PrivateDevices
    # keeps it (systemd bind-mounts it into the private /dev); nothing may replace it.
    for key in ("TemporaryFileSystem", "InaccessiblePaths", "ReadOnlyPaths"):
        assert not any("/dev/shm" in v for v in service().get(key, [])), key
    assert "MemoryDenyWriteExecute" not in service(), "JITs in datasets (numba, torch.compile) need it off"


def test_systemd_config_socket_is_in_the_runtime_directory(tmp_path: Path) -> None:
    raw = systemd_config()
    (listener,) = check_contract(raw)
    assert listener.unix
    assert listener.socket_path == f"/run/{setting('RuntimeDirectory')}/loaderd.sock", "PrivateTmp: not in /tmp"
    assert listener.socket_mode == 0o660
    assert listener.socket_group == CLIENT_GROUP, "clients join their own group, never the daemon's"
    assert listener.socket_group != setting("Group"), "the daemon's group reads its TLS key and tokens"
    assert listener.socket_group in supplementary_groups(), "the daemon must be in the group to chown its socket"
    config = parse_with_loaderd((SYSTEMD / "loaderd.yaml").read_text(), tmp_path / "etc" / "loaderd.yaml", tmp_path / "files")
    assert config.drain_timeout == raw["drain_timeout"]


def test_systemd_config_examples_follow_the_format() -> None:
    """The commented-out TLS listener and auth, switched on, are valid too."""
    listeners = check_contract(yaml.safe_load(uncommented((SYSTEMD / "loaderd.yaml").read_text())))
    assert [lst.address for lst in listeners if lst.tls] == ["0.0.0.0:7070"]
    assert yaml.safe_load(uncommented((SYSTEMD / "loaderd.yaml").read_text()))["auth"]["token_file"].startswith("/etc/loaderd/")


def verify(unit: Path) -> subprocess.CompletedProcess[str]:
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None
    return subprocess.run(
        [analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
    )


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    """``systemd-analyze verify`` says nothing about the unit (ExecStart pointed at a binary that exists)."""
    true = shutil.which("true")
    assert true is not None
    # First a trivial unit: if even that fails, verify does not work in this environment.
    probe = tmp_path / "probe.service"
    probe.write_text(f"[Service]\nExecStart={true}\n")
    result = verify(probe)
    if result.returncode != 0:
        pytest.skip(f"systemd-analyze verify does not work here: {(result.stderr or result.stdout).strip()[:300]}")
    text = UNIT.read_text().replace("ExecStart=/usr/local/bin/loaderd ", f"ExecStart={true} ")
    assert text != UNIT.read_text()
    unit = tmp_path / "loaderd.service"
    unit.write_text(text)
    result = verify(unit)
    complaints = [line for line in (result.stdout + result.stderr).splitlines() if "loaderd.service" in line]
    assert result.returncode == 0 and not complaints, result.stdout + result.stderr


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers is not installed")
def test_sysusers_creates_the_user(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    result = subprocess.run(
        ["systemd-sysusers", f"--root={tmp_path}", "--dry-run", str(SYSTEMD / "loaderd.sysusers")],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )
    output = result.stdout + result.stderr
    if result.returncode != 0:
        pytest.skip(f"systemd-sysusers --dry-run does not work here: {output.strip()[:300]}")
    assert "Creating user 'loaderd'" in output and "Creating group 'loaderd'" in output, output
    assert f"Creating group '{CLIENT_GROUP}'" in output, output


# ---------------------------------------------------------------- container

DOCKERFILE_INSTRUCTIONS = {
    "ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK",
    "LABEL", "MAINTAINER", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR",
}  # fmt: skip


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order; continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        line = pending + stripped
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        word, _, rest = line.partition(" ")
        instructions.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


def args_of(kind: str) -> list[str]:
    return [rest for word, rest in dockerfile() if word == kind]


def exec_form(rest: str) -> list[str]:
    value = yaml.safe_load(rest)  # a JSON array is YAML
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"not an exec-form array: {rest}"
    return value


def test_dockerfile_instructions_are_known() -> None:
    words = [word for word, _ in dockerfile()]
    assert set(words) <= DOCKERFILE_INSTRUCTIONS, sorted(set(words) - DOCKERFILE_INSTRUCTIONS)
    assert words[0] == "FROM" and words.count("FROM") == 1
    for once in ("ENTRYPOINT", "CMD", "HEALTHCHECK", "USER"):
        assert words.count(once) == 1, once


def test_base_image_is_pinned() -> None:
    (base,) = args_of("FROM")
    assert re.fullmatch(r"python:3\.12\.\d+-slim(-[a-z]+)?(@sha256:[0-9a-f]{64})?", base), f"pin a patch release: {base}"


def test_runs_as_non_root() -> None:
    words = [word for word, _ in dockerfile()]
    (user,) = args_of("USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0, "a numeric, non-root uid (runAsNonRoot checks it)"
    assert not gid or (gid.isdigit() and int(gid) > 0)
    assert words.index("USER") < words.index("ENTRYPOINT") and words.index("USER") < words.index("CMD")
    assert all(w not in ("RUN", "COPY", "ADD") for w in words[words.index("USER") :]), "nothing is installed as the user"
    # The same uid as the Kubernetes Deployment.
    deployment = yaml.safe_load((REPO / "deploy" / "k8s" / "deployment.yaml").read_text())
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(uid)


def container_config() -> tuple[Path, dict]:
    """The config the image's CMD names: the file COPY puts there."""
    (entrypoint,) = args_of("ENTRYPOINT")
    (cmd,) = args_of("CMD")
    command = exec_form(entrypoint) + exec_form(cmd)
    assert command == ["loaderd", "serve", "--config", CONFIG_PATH]
    sources = [parts[:-1] for parts in (rest.split() for rest in args_of("COPY")) if parts[-1] == CONFIG_PATH]
    assert sources == [["deploy/container/loaderd.yaml"]], "the config CMD names is the example, copied there"
    path = REPO / sources[0][0]
    return path, yaml.safe_load(path.read_text())


def test_command_config_exists_and_parses(tmp_path: Path) -> None:
    path, raw = container_config()
    config = parse_with_loaderd(path.read_text(), tmp_path / "etc" / "loaderd" / "loaderd.yaml", tmp_path / "files")
    # Its datasets' modules are copied into python_path.
    destinations = {parts[-1] for parts in (rest.split() for rest in args_of("COPY"))}
    for spec in config.datasets.values():
        module = spec.factory.partition(":")[0]
        assert any(f"{d}/{module}.py" in destinations for d in raw["python_path"]), f"{module}.py is not in the image"
    listeners = check_contract(yaml.safe_load(uncommented(path.read_text())))
    assert any(lst.tls for lst in listeners), "the commented TLS listener, switched on, is valid"


def unix_listener() -> Listener:
    _, raw = container_config()
    (listener,) = [lst for lst in check_contract(raw) if lst.unix]
    return listener


def test_healthcheck_asks_the_health_service_without_torch_or_a_token() -> None:
    (healthcheck,) = args_of("HEALTHCHECK")
    options = dict(re.findall(r"--([a-z-]+)=(\S+)", healthcheck))
    assert {"interval", "timeout", "start-period", "retries"} <= set(options)
    command = exec_form(healthcheck[healthcheck.index("CMD") + len("CMD") :].strip())
    assert command[:2] == ["python", "-c"]
    script = command[2]
    assert f"grpc.insecure_channel('{unix_listener().address}')" in script
    assert "HealthStub" in script and "loaderd" not in script.replace(unix_listener().address, "")
    compile(script, "HEALTHCHECK", "exec")  # it is valid Python
    check_timeout = float(re.search(r"timeout=(\d+(?:\.\d+)?)", script).group(1))  # type: ignore[union-attr]
    assert seconds(options["timeout"]) >= check_timeout + 5


def user_setup() -> str:
    """The RUN that creates the user (and its groups)."""
    (run,) = [run for run in args_of("RUN") if "useradd" in run]
    return run


def test_image_creates_the_client_group_and_the_user_is_in_it() -> None:
    run = user_setup()
    assert re.search(rf"groupadd (--system )?--gid {DAEMON_GID} {DAEMON_GROUP}(\s|$)", run)
    assert re.search(rf"groupadd (--system )?--gid {CLIENT_GID} {CLIENT_GROUP}(\s|$)", run), "a fixed gid clients can name"
    (useradd,) = re.findall(r"useradd [^&]*", run)
    assert re.search(rf"(--gid|-g) {DAEMON_GROUP}\s", useradd), "the daemon's primary group is its own"
    supplementary = re.search(r"(?:--groups|-G) (\S+)", useradd)
    assert supplementary and CLIENT_GROUP in supplementary.group(1).split(","), "loaderd must be in the socket's group"
    # The uid alone: with an explicit group (USER 10001:10001) the runtime applies no
    # supplementary groups from /etc/group, and the daemon could not chown its socket.
    (user,) = args_of("USER")
    assert ":" not in user, f"USER {user}: name the uid alone so /etc/group's memberships apply"
    assert f"--uid {user}" in useradd
    # Derived images (USER root to pip-install datasets) must switch back the same way.
    readme = (CONTAINER / "README.md").read_text()
    assert f"back to `USER {user}`" in readme and f"back to `USER {user}:" not in readme
    assert unix_listener().socket_group == CLIENT_GROUP != DAEMON_GROUP


def test_socket_directory_belongs_to_the_user() -> None:
    socket_dir = unix_listener().socket_path.rsplit("/", 1)[0]
    assert f"install -d -o loaderd -g {CLIENT_GROUP} -m 0750 {socket_dir}" in user_setup(), "the daemon and its clients only"
    assert unix_listener().socket_mode == 0o660 and unix_listener().socket_group == CLIENT_GROUP


DEPLOY_TEXTS = [*sorted(SYSTEMD.iterdir()), *sorted(CONTAINER.iterdir())]
JOIN_DAEMON_GROUP = [
    re.compile(rf"usermod\s+-a?G\s+{DAEMON_GROUP}(?![\w-])"),
    re.compile(rf"gpasswd\s+-a\s+\S+\s+{DAEMON_GROUP}(?![\w-])"),
    re.compile(rf"group-add[ =](?:{DAEMON_GROUP}(?![\w-])|{DAEMON_GID}\b)"),
    re.compile(rf"group_add:[^\n]*\b{DAEMON_GID}\b"),
]


def test_no_client_is_told_to_join_the_daemons_group() -> None:
    """Members of loaderd read the daemon's TLS key and tokens; clients join loaderd-clients."""
    for path in DEPLOY_TEXTS:
        text = path.read_text()
        for pattern in JOIN_DAEMON_GROUP:
            assert not pattern.search(text), f"{path.name}: {pattern.search(text).group(0)!r}"  # type: ignore[union-attr]
    assert f"usermod -aG {CLIENT_GROUP} " in (SYSTEMD / "README.md").read_text()
    assert f"usermod -aG {CLIENT_GROUP} " in (SYSTEMD / "loaderd.sysusers").read_text()
    assert f"--group-add {CLIENT_GID}" in (CONTAINER / "README.md").read_text()
    assert f"--group-add {CLIENT_GID}" in (CONTAINER / "loaderd.yaml").read_text()


def test_healthcheck_is_not_said_to_need_a_token() -> None:
    """The HEALTHCHECK calls the health service's Check, which auth exempts."""
    for path in (CONTAINER / "loaderd.yaml", CONTAINER / "README.md", DOCKERFILE):
        for line in path.read_text().splitlines():
            assert not ("HEALTHCHECK" in line and "LOADERD_TOKEN" in line), f"{path.name}: {line.strip()}"


def torch_pins(text: str) -> set[str]:
    return set(re.findall(r"torch==([0-9][0-9.]*[0-9])", text))


def project_pins(text: str) -> set[str]:
    """torch pins of the project's own install commands: a line that pairs torch with a torchvision (the install
    notes' way around PyPI's CUDA torchvision) names another release on purpose."""
    return torch_pins("\n".join(line for line in text.splitlines() if "torchvision==" not in line))


def test_torch_pin_is_the_projects() -> None:
    (docker_pin,) = torch_pins(DOCKERFILE.read_text())
    assert project_pins((REPO / "README.md").read_text()) == {docker_pin}
    assert project_pins((REPO / "docs" / "pages" / "getting-started.md").read_text()) == {docker_pin}
    for page in sorted((REPO / "docs" / "pages").rglob("*.md")):
        assert project_pins(page.read_text()) <= {docker_pin}, page.relative_to(REPO)
    assert torch_pins((REPO / ".ci" / "run").read_text()) == {docker_pin}
    assert torch_pins((CONTAINER / "README.md").read_text()) <= {docker_pin}
    assert torch_pins((SYSTEMD / "README.md").read_text()) <= {docker_pin}
    floor = re.search(r'"torch>=([0-9.]+)"', (REPO / "pyproject.toml").read_text())
    assert floor is not None
    as_tuple = lambda v: tuple(int(p) for p in v.split("."))  # noqa: E731 - a one-line probe, read where it is used
    assert as_tuple(docker_pin) >= as_tuple(floor.group(1))
    assert any(f"--index-url https://download.pytorch.org/whl/cpu torch=={docker_pin}" in run for run in args_of("RUN"))


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether ``.dockerignore``'s patterns leave ``path`` out (the last matching pattern decides)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        candidates = [pattern, pattern[3:]] if pattern.startswith("**/") else [pattern]
        hit = any(
            fnmatch.fnmatchcase(prefix, candidate) or (candidate is not pattern and fnmatch.fnmatchcase(prefix.rsplit("/", 1)[-1], candidate))
            for prefix in prefixes
            for candidate in candidates
        )
        if hit:
            ignored = not negated
    return ignored


def test_copied_files_exist_and_are_in_the_build_context() -> None:
    patterns = [
        line.strip() for line in (REPO / ".dockerignore").read_text().splitlines() if line.strip() and not line.startswith("#")
    ]
    for rest in args_of("COPY"):
        *sources, _ = rest.split()
        assert not any(s.startswith("--") for s in sources), "plain COPY only"
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: no such file in the repository"
            files = [source] if (REPO / source).is_file() else [
                str(p.relative_to(REPO)) for p in (REPO / source).rglob("*.py") if "__pycache__" not in p.parts
            ]
            for file in files:
                assert not dockerignored(file, patterns), f"{file} is copied but .dockerignore leaves it out"
    for heavy in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "server/__pycache__/cli.cpython-312.pyc"):
        assert dockerignored(heavy, patterns), f"{heavy} should stay out of the build context"


def test_example_files_are_private_enough() -> None:
    """Nothing in deploy/ is a secret, and nothing there is world-writable."""
    for path in (SYSTEMD.iterdir(), CONTAINER.iterdir()):
        for file in path:
            assert not file.stat().st_mode & stat.S_IWOTH, file
            assert "-----BEGIN" not in file.read_text(), f"{file} holds key material"
