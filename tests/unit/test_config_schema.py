"""The config's declared schema: the JSON Schema in deploy/ is the model's, it accepts what loaderd accepts, and
the pool's processes never load pydantic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import jsonschema
import pytest
import yaml

from loaderd.server.config.document import SCHEMA_FILE, json_schema_text
from loaderd.server.config.schema import ConfigError, parse_config
from loaderd.server.config.values import LogFormat
from loaderd.server.process.log_format import LOG_FORMATS

REPO = Path(__file__).resolve().parents[2]
SCHEMA_PATH = REPO / "deploy" / SCHEMA_FILE
PATH = Path("/etc/loaderd/ds.yaml")


def validator() -> jsonschema.protocols.Validator:
    schema = json.loads(SCHEMA_PATH.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def deploy_configs() -> dict[str, Any]:
    """Every example config under deploy/, parsed: the files, and the one in the Kubernetes ConfigMap."""
    configs = {str(p.relative_to(REPO)): yaml.safe_load(p.read_text()) for p in sorted((REPO / "deploy").rglob("*.yaml")) if "k8s" not in p.parts}
    configmap = yaml.safe_load((REPO / "deploy" / "k8s" / "configmap.yaml").read_text())
    configs["deploy/k8s/configmap.yaml: ds.yaml"] = yaml.safe_load(configmap["data"]["ds.yaml"])
    return configs


@pytest.mark.timeout(30)
def test_the_committed_schema_is_the_models() -> None:
    assert SCHEMA_PATH.read_text() == json_schema_text(), f"{SCHEMA_FILE} is stale: run python tests/gen_config_schema.py"


@pytest.mark.timeout(30)
def test_the_committed_config_reference_is_the_schemas() -> None:
    """docs/pages/reference/config.md, the docs' config reference, is generated from the same schema."""
    from gen_config_schema import REFERENCE, reference_text

    expected = reference_text(json.loads(json_schema_text()))
    assert REFERENCE.exists() and REFERENCE.read_text() == expected, f"{REFERENCE.relative_to(REPO)} is stale: run python tests/gen_config_schema.py"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(deploy_configs()))
def test_deploy_configs_follow_the_schema(name: str) -> None:
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator().iter_errors(deploy_configs()[name])]
    assert not errors, errors


@pytest.mark.timeout(30)
def test_the_example_config_names_the_schema() -> None:
    assert f"# yaml-language-server: $schema={SCHEMA_FILE}" in (REPO / "deploy" / "ds.yaml").read_text()


DS = {"datasets": {"train": {"dataset": "m:A"}}}
AGREED = [
    # (document, valid): the schema's verdict must be loaderd's.
    (DS, True),
    ({**DS, "log_level": "debug", "log_format": "json", "listen": "unix:///tmp/x.sock", "metrics": None, "limits": None}, True),
    ({**DS, "listen": [{"address": "unix:///run/l.sock", "socket_mode": 0o660, "socket_group": 1000}, "127.0.0.1:1"]}, True),
    ({**DS, "listen": [{"address": "0.0.0.0:1", "tls": {"cert": "c", "key": "k"}}], "drain_timeout": 0, "share_buffer": 0}, True),
    ({"datasets": {"t": {"dataset": "m:A.B", "args": None, "kwargs": {"n": 1}, "collate_fn": "m:c", "task_timeout": 2.5, "build": "once"}}}, True),
    ({**DS, "worker": 4}, False),
    ({**DS, "workers": "4"}, False),
    ({**DS, "workers": 0}, False),
    ({**DS, "workers": True}, False),
    ({"datasets": {}}, False),
    ({"listen": "127.0.0.1:1"}, False),
    ({"datasets": {"t": {"dataset": "mod.Class"}}}, False),
    ({"datasets": {"t": {"dataset": "m:A", "build": "twice"}}}, False),
    ({"datasets": {"t": {"dataset": "m:A", "kwarg": {}}}}, False),
    ({**DS, "chunk_bytes": (16 << 20) + 1}, False),
    ({**DS, "log_level": "LOUD"}, False),
    ({**DS, "metrics": {"port": 65536}}, False),
    ({**DS, "metrics": {"host": " "}}, False),
    ({**DS, "listen": []}, False),
    ({**DS, "listen": [{"address": "0.0.0.0:1", "tls": {"cert": "c"}}]}, False),
    ({**DS, "python_path": "."}, False),
    ({**DS, "drain_timeout": -1}, False),
    ({**DS, "limits": {"max_streams": 0}}, False),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("document", "valid"), AGREED)
def test_the_schema_and_loaderd_agree(document: dict[str, Any], valid: bool) -> None:
    try:
        parse_config(document, PATH)
        loaderd_valid = True
    except ConfigError:
        loaderd_valid = False
    assert (loaderd_valid, validator().is_valid(document)) == (valid, valid)


@pytest.mark.timeout(30)
def test_log_formats_are_the_loggers() -> None:
    assert get_args(LogFormat) == LOG_FORMATS


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", [True, False])
def test_a_socket_group_is_a_name_or_a_gid_not_a_boolean(value: bool) -> None:
    """The hand-written parser let a boolean through, which chown would have taken for gid 1 or 0."""
    with pytest.raises(ConfigError) as info:
        parse_config({**DS, "listen": [{"address": "unix:///tmp/x.sock", "socket_group": value}]}, PATH)
    assert str(info.value) == f"listen[0].socket_group: expected a group name or id, got bool {value}"


@pytest.mark.timeout(60)
def test_the_pools_processes_import_neither_pydantic_nor_yaml() -> None:
    """The fork server and workers import the config's classes, never its parser (~100 ms and several MB)."""
    probe = (
        "import sys, loaderd.server.config, loaderd.server.config.schema, loaderd.server.worker.entry, loaderd.server.pool.pool\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'pydantic', 'pydantic_core', 'yaml'}))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=50, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
