"""Unit tests of the daemon's config: parsing, validation messages, and import checks."""

from __future__ import annotations

import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from loaderd.server.config.schema import DEFAULT_LISTEN, ConfigError, DatasetSpec, ListenSpec, MetricsConfig, TlsSpec, load_config, parse_config
from loaderd.server.process.host_cpu import usable_cpus
from loaderd.server.worker.user_code import check_imports

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "ds.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def minimal(**top: Any) -> dict[str, Any]:
    return {"datasets": {"sq": {"dataset": "support.datasets:Squares"}}, **top}


@pytest.fixture
def isolated_sys_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """check_imports prepends python_path to sys.path: keep that inside the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))


# ------------------------------------------------------------------ valid configs


@pytest.mark.timeout(30)
def test_valid_config_with_relative_python_path(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    path = write(
        tmp_path,
        """
        listen:
          - unix:///tmp/x.sock
          - 127.0.0.1:7070
        workers: 3
        python_path: [., sub, /abs/dir]
        chunk_bytes: 1024
        max_window: 8
        share_buffer: 0
        log_level: debug
        datasets:
          train:
            dataset: mymod:Train
            args: [1, two]
            kwargs: {split: train, size: 10}
            collate_fn: mymod:collate
            worker_init_fn: mymod.sub:init
          val:
            dataset: mymod:Make.nested
        """,
    )
    config = load_config(path)
    assert config.path == path.resolve()
    assert config.addresses == ("unix:///tmp/x.sock", "127.0.0.1:7070")
    assert config.workers == 3
    assert config.python_path == (str(tmp_path.resolve()), str((tmp_path / "sub").resolve()), "/abs/dir")
    assert config.chunk_bytes == 1024
    assert config.max_window == 8
    assert config.share_buffer == 0
    assert config.log_level == "DEBUG"
    assert list(config.datasets) == ["train", "val"]
    assert config.datasets["train"] == DatasetSpec(
        name="train",
        factory="mymod:Train",
        args=(1, "two"),
        kwargs={"split": "train", "size": 10},
        collate_fn="mymod:collate",
        worker_init_fn="mymod.sub:init",
    )
    assert config.datasets["val"] == DatasetSpec(name="val", factory="mymod:Make.nested")


@pytest.mark.timeout(30)
def test_relative_python_path_resolves_against_config_dir_not_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    path = write(conf_dir, "python_path: [., ../lib]\ndatasets: {a: {dataset: 'm:A'}}\n")
    config = load_config(path)
    assert config.python_path == (str(conf_dir.resolve()), str((tmp_path / "lib").resolve()))
    # A relative config path is resolved too.
    config2 = load_config(Path("..") / "conf" / "ds.yaml")
    assert config2.python_path == config.python_path
    assert config2.path == path.resolve()


@pytest.mark.timeout(30)
def test_listen_as_string(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "listen: unix:///tmp/one.sock\ndatasets: {a: {dataset: 'm:A'}}\n"))
    assert config.addresses == ("unix:///tmp/one.sock",)


@pytest.mark.timeout(30)
def test_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "datasets:\n  a:\n    dataset: m:A\n"))
    assert config.addresses == DEFAULT_LISTEN == ("unix:///tmp/loaderd.sock",)
    assert config.workers == 2
    assert config.python_path == ()
    assert config.chunk_bytes == 4 << 20
    assert config.max_window == 64
    assert config.share_buffer == 32
    assert config.log_level == "INFO"
    spec = config.datasets["a"]
    assert (spec.args, spec.kwargs, spec.collate_fn, spec.worker_init_fn) == ((), {}, None, None)
    assert spec.build == "per_worker"


@pytest.mark.timeout(30)
def test_build_once(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "datasets:\n  a:\n    dataset: m:A\n    build: once\n"))
    assert config.datasets["a"].build == "once"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", ["twice", "true", "Once"])
def test_bad_build(tmp_path: Path, value: str) -> None:
    message = entry_error(tmp_path, "build", value)
    assert "datasets.train.build" in message and "per_worker, once" in message


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("value", "want"), [("1", 1), ("16", 16), ("64", 64), ("auto", "auto")])
def test_threads(tmp_path: Path, value: str, want: int | str) -> None:
    config = load_config(write(tmp_path, f"datasets:\n  a:\n    dataset: m:A\n    threads: {value}\n"))
    assert config.datasets["a"].threads == want


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("value", "expect"),
    [("0", "must be from 1 to 64, or 'auto', got 0"), ("65", "got 65"), ("Auto", "expected an integer or 'auto', got str 'Auto'"),
     ("true", "got bool True"), ("2.5", "got float 2.5")],
)  # fmt: skip
def test_bad_threads(tmp_path: Path, value: str, expect: str) -> None:
    message = entry_error(tmp_path, "threads", value)
    assert "datasets.train.threads" in message and expect in message


@pytest.mark.timeout(30)
def test_parse_config_directly() -> None:
    config = parse_config(minimal(workers=5, listen=["127.0.0.1:1"]), Path("/etc/loaderd/ds.yaml"))
    assert config.workers == 5
    assert config.addresses == ("127.0.0.1:1",)
    assert config.datasets["sq"].factory == "support.datasets:Squares"


@pytest.mark.timeout(30)
def test_deploy_config_loads() -> None:
    config = load_config(REPO / "deploy" / "ds.yaml")
    assert config.addresses == ("unix:///tmp/loaderd.sock", "127.0.0.1:7070")
    assert (config.min_workers, config.workers) == (1, 4 * usable_cpus()), "workers: auto"
    assert config.python_path == (str((REPO / "deploy").resolve()),)
    assert set(config.datasets) == {"digits-train", "digits-val", "counting"}
    assert config.datasets["digits-train"].factory == "example_datasets:Digits"
    assert config.datasets["digits-train"].kwargs == {"split": "train", "noise": 0.05}
    assert config.datasets["digits-val"].kwargs == {"split": "val"}
    assert config.datasets["counting"].kwargs == {"n": 1000}


@pytest.mark.timeout(60)
def test_deploy_config_imports_check(isolated_sys_path: None) -> None:
    config = load_config(REPO / "deploy" / "ds.yaml")
    check_imports(config)  # raises ConfigError on failure
    assert sys.path[0] == str((REPO / "deploy").resolve())


# ------------------------------------------------------------------ errors


def config_error(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    message = str(info.value)
    assert message.strip(), "empty ConfigError message"
    return message


def entry_error(tmp_path: Path, key: str, value: str) -> str:
    """The ConfigError for dataset "train" (``dataset: m:A``) with ``key: value`` added to its entry."""
    return config_error(tmp_path, f"datasets:\n  train:\n    dataset: m:A\n    {key}: {value}\n")


@pytest.mark.timeout(30)
def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config") as info:
        load_config(tmp_path / "nope.yaml")
    assert "nope.yaml" in str(info.value)


@pytest.mark.timeout(30)
def test_yaml_syntax_error(tmp_path: Path) -> None:
    message = config_error(tmp_path, "workers: 2\ndatasets: [a, b\nlisten: x\n")
    assert "invalid YAML" in message
    assert "ds.yaml" in message
    assert "line" in message


@pytest.mark.timeout(30)
@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_top_level_not_a_mapping(tmp_path: Path, text: str) -> None:
    message = config_error(tmp_path, text)
    assert "ds.yaml" in message
    assert "mapping at the top level" in message


@pytest.mark.timeout(30)
def test_empty_file_says_no_dataset(tmp_path: Path) -> None:
    message = config_error(tmp_path, "")
    assert "datasets" in message


@pytest.mark.timeout(30)
def test_unknown_top_key(tmp_path: Path) -> None:
    message = config_error(tmp_path, "worker: 4\ndatasets: {a: {dataset: 'm:A'}}\n")
    assert "unknown key 'worker' (did you mean 'workers'? allowed: " in message
    assert "workers" in message  # the allowed keys are listed, so the typo is obvious


@pytest.mark.timeout(30)
def test_an_unknown_key_like_no_allowed_one_gets_no_guess(tmp_path: Path) -> None:
    message = config_error(tmp_path, "zzzqqq: 4\ndatasets: {a: {dataset: 'm:A'}}\n")
    assert "unknown key 'zzzqqq' (allowed: " in message and "did you mean" not in message


@pytest.mark.timeout(30)
def test_unknown_dataset_key(tmp_path: Path) -> None:
    message = entry_error(tmp_path, "kwarg", "{a: 1}")
    assert "datasets.train" in message
    assert "unknown key 'kwarg' (did you mean 'kwargs'? allowed: " in message
    assert "kwargs" in message


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("value", "expect"),
    [("-1", "at least 1"), ("0", "at least 1"), ("four", "expected an integer"), ("true", "expected an integer"),
     ("2.5", "expected an integer"), ("null", "expected an integer")],
)  # fmt: skip
def test_bad_workers(tmp_path: Path, value: str, expect: str) -> None:
    message = config_error(tmp_path, f"workers: {value}\ndatasets: {{a: {{dataset: 'm:A'}}}}\n")
    assert message.startswith("workers:"), message
    assert expect in message


@pytest.mark.timeout(30)
@pytest.mark.parametrize("key", ["chunk_bytes", "max_window"])
def test_bad_positive_ints(tmp_path: Path, key: str) -> None:
    message = config_error(tmp_path, f"{key}: 0\ndatasets: {{a: {{dataset: 'm:A'}}}}\n")
    assert message.startswith(f"{key}:") and "at least 1" in message


@pytest.mark.timeout(30)
def test_negative_share_buffer(tmp_path: Path) -> None:
    message = config_error(tmp_path, "share_buffer: -1\ndatasets: {a: {dataset: 'm:A'}}\n")
    assert message.startswith("share_buffer:") and "at least 0" in message


@pytest.mark.timeout(30)
@pytest.mark.parametrize("text", ["listen: x\n", "datasets:\n", "datasets: {}\n", "datasets: []\n"])
def test_datasets_missing_or_empty(tmp_path: Path, text: str) -> None:
    message = config_error(tmp_path, text)
    assert message.startswith("datasets:"), message
    assert "no dataset" in message


@pytest.mark.timeout(30)
def test_datasets_not_a_mapping(tmp_path: Path) -> None:
    message = config_error(tmp_path, "datasets: [a, b]\n")
    assert message.startswith("datasets:")
    assert "mapping" in message


@pytest.mark.timeout(30)
def test_dataset_entry_missing_dataset(tmp_path: Path) -> None:
    message = config_error(tmp_path, "datasets:\n  train:\n    kwargs: {a: 1}\n")
    assert "datasets.train" in message
    assert "'dataset'" in message


@pytest.mark.timeout(30)
def test_dataset_entry_not_a_mapping(tmp_path: Path) -> None:
    message = config_error(tmp_path, "datasets:\n  train: m:A\n")
    assert "datasets.train" in message


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", ["mod.Class", "mod", ":Class", "mod:"])
def test_bad_import_path(tmp_path: Path, bad: str) -> None:
    message = config_error(tmp_path, f"datasets:\n  train:\n    dataset: '{bad}'\n")
    assert "datasets.train.dataset" in message
    assert repr(bad) in message
    assert "module:attribute" in message


@pytest.mark.timeout(30)
@pytest.mark.parametrize("key", ["collate_fn", "worker_init_fn"])
def test_bad_import_path_in_optional_callables(tmp_path: Path, key: str) -> None:
    message = entry_error(tmp_path, key, "m.collate")
    assert f"datasets.train.{key}" in message
    assert "'m.collate'" in message


@pytest.mark.timeout(30)
def test_import_path_not_a_string(tmp_path: Path) -> None:
    message = config_error(tmp_path, "datasets:\n  train:\n    dataset: 42\n")
    assert "datasets.train.dataset" in message
    assert "42" in message


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("key", "value", "expect"),
    [("args", "5", "a list"), ("args", "abc", "a list"), ("args", "{a: 1}", "a list"),
     ("kwargs", "[1, 2]", "a mapping"), ("kwargs", "5", "a mapping"), ("kwargs", "abc", "a mapping")],
)  # fmt: skip
def test_args_not_a_list_and_kwargs_not_a_mapping(tmp_path: Path, key: str, value: str, expect: str) -> None:
    message = entry_error(tmp_path, key, value)
    assert f"datasets.train.{key}" in message
    assert expect in message


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("key", "value"), [("args", "{}"), ("args", "false"), ("kwargs", "[]"), ("kwargs", "0")])
def test_empty_values_of_the_wrong_type_are_rejected(tmp_path: Path, key: str, value: str) -> None:
    """A wrong type is a config mistake even when the value happens to be empty or falsy."""
    message = entry_error(tmp_path, key, value)
    assert f"datasets.train.{key}" in message


@pytest.mark.timeout(30)
@pytest.mark.parametrize("text", ["listen: []\n", "listen: {a: 1}\n", "listen: [1]\n"])
def test_bad_listen(tmp_path: Path, text: str) -> None:
    message = config_error(tmp_path, text + "datasets: {a: {dataset: 'm:A'}}\n")
    assert message.startswith("listen"), message


@pytest.mark.timeout(30)
def test_bad_log_level(tmp_path: Path) -> None:
    message = config_error(tmp_path, "log_level: LOUD\ndatasets: {a: {dataset: 'm:A'}}\n")
    assert message.startswith("log_level:") and "'LOUD'" in message


@pytest.mark.timeout(30)
def test_bad_python_path(tmp_path: Path) -> None:
    message = config_error(tmp_path, "python_path: .\ndatasets: {a: {dataset: 'm:A'}}\n")
    assert message.startswith("python_path")


# ------------------------------------------------------------------ metrics


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("text", "expect"),
    [("", None), ("metrics: {port: 9100}\n", MetricsConfig(9100, "127.0.0.1")),
     ("metrics: {port: 0, host: 0.0.0.0}\n", MetricsConfig(0, "0.0.0.0")),
     ("metrics: {host: '::1'}\n", MetricsConfig(9464, "::1")), ("metrics:\n", MetricsConfig())],
)  # fmt: skip
def test_metrics(tmp_path: Path, text: str, expect: MetricsConfig | None) -> None:
    assert load_config(write(tmp_path, text + "datasets: {a: {dataset: 'm:A'}}\n")).metrics == expect


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("value", "culprit", "expect"),
    [("{port: -1}", "metrics.port", "from 0 to 65535, got -1"), ("{port: 65536}", "metrics.port", "got 65536"),
     ("{port: http}", "metrics.port", "expected a port number"), ("{port: true}", "metrics.port", "expected a port"),
     ("{port: 9.5}", "metrics.port", "expected a port"), ("{host: 7}", "metrics.host", "expected a host name"),
     ("{host: ''}", "metrics.host", "must not be empty"), ("9464", "metrics", "expected a mapping"),
     ("{prot: 1}", "metrics", "unknown key 'prot' (did you mean 'port'? allowed: host, port, require_token)")],
)  # fmt: skip
def test_bad_metrics(tmp_path: Path, value: str, culprit: str, expect: str) -> None:
    message = config_error(tmp_path, f"metrics: {value}\ndatasets: {{a: {{dataset: 'm:A'}}}}\n")
    assert message.startswith(f"{culprit}:"), message
    assert expect in message, message


@pytest.mark.timeout(60)
@pytest.mark.parametrize("port", ["-1", "65536"])
def test_bad_metrics_port_option_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], port: str) -> None:
    from loaderd.server.app.cli import EXIT_CONFIG, main

    path = write(tmp_path, "datasets: {a: {dataset: 'm:A'}}\n")
    assert main(["serve", "--config", str(path), "--metrics-port", port]) == EXIT_CONFIG
    err = capsys.readouterr().err.strip()
    assert err == f"loaderd: config error: --metrics-port: must be a port number from 0 to 65535, got {port}"


# ------------------------------------------------------------------ check_imports


def module_dir(tmp_path: Path) -> tuple[Path, str]:
    """A directory with a uniquely named module (so no test sees another's sys.modules entry)."""
    name = f"ld_cfg_mod_{uuid.uuid4().hex[:10]}"
    d = tmp_path / "mods"
    d.mkdir()
    (d / f"{name}.py").write_text(
        "class Good:\n    pass\n\nclass Outer:\n    class Inner:\n        pass\n\nNOT_CALLABLE = 3\n\n"
        "def collate(batch):\n    return batch\n"
    )
    return d, name


def imports_config(tmp_path: Path, entry: dict[str, Any], mods: Path) -> Path:
    text = yaml.safe_dump({"python_path": [str(mods)], "datasets": {"train": entry}})
    return write(tmp_path, text)


def check_imports_error(tmp_path: Path, entry: dict[str, Any], mods: Path) -> str:
    """The ConfigError check_imports raises for dataset "train" (``entry``, importing from ``mods``)."""
    config = load_config(imports_config(tmp_path, entry, mods))
    with pytest.raises(ConfigError) as info:
        check_imports(config)
    return str(info.value)


@pytest.mark.timeout(30)
def test_check_imports_ok(tmp_path: Path, isolated_sys_path: None) -> None:
    mods, name = module_dir(tmp_path)
    config = load_config(
        imports_config(tmp_path, {"dataset": f"{name}:Outer.Inner", "collate_fn": f"{name}:collate"}, mods)
    )
    check_imports(config)
    assert str(mods.resolve()) in sys.path
    sys.modules.pop(name, None)


@pytest.mark.timeout(30)
def test_check_imports_module_does_not_import(tmp_path: Path, isolated_sys_path: None) -> None:
    mods, _ = module_dir(tmp_path)
    missing = f"ld_no_such_module_{uuid.uuid4().hex[:8]}"
    message = check_imports_error(tmp_path, {"dataset": f"{missing}:Thing"}, mods)
    assert message.startswith("datasets.train.dataset:"), message
    assert missing in message
    assert "ModuleNotFoundError" in message


@pytest.mark.timeout(30)
def test_check_imports_module_raises_on_import(tmp_path: Path, isolated_sys_path: None) -> None:
    mods, _ = module_dir(tmp_path)
    name = f"ld_broken_{uuid.uuid4().hex[:8]}"
    (mods / f"{name}.py").write_text("raise RuntimeError('import-time failure')\n")
    message = check_imports_error(tmp_path, {"dataset": f"{name}:X"}, mods)
    assert message.startswith("datasets.train.dataset:"), message
    assert name in message and "import-time failure" in message


@pytest.mark.timeout(30)
def test_check_imports_attribute_does_not_exist(tmp_path: Path, isolated_sys_path: None) -> None:
    mods, name = module_dir(tmp_path)
    message = check_imports_error(tmp_path, {"dataset": f"{name}:Goood"}, mods)
    assert message.startswith("datasets.train.dataset:"), message
    assert "'Goood'" in message and name in message
    sys.modules.pop(name, None)


@pytest.mark.timeout(30)
def test_check_imports_nested_attribute_does_not_exist(tmp_path: Path, isolated_sys_path: None) -> None:
    mods, name = module_dir(tmp_path)
    message = check_imports_error(tmp_path, {"dataset": f"{name}:Good", "collate_fn": f"{name}:Outer.Nope"}, mods)
    assert message.startswith("datasets.train.collate_fn:"), message
    assert "Outer.Nope" in message
    sys.modules.pop(name, None)


@pytest.mark.timeout(30)
def test_check_imports_not_callable(tmp_path: Path, isolated_sys_path: None) -> None:
    mods, name = module_dir(tmp_path)
    message = check_imports_error(tmp_path, {"dataset": f"{name}:Good", "worker_init_fn": f"{name}:NOT_CALLABLE"}, mods)
    assert message.startswith("datasets.train.worker_init_fn:"), message
    assert "not callable" in message
    sys.modules.pop(name, None)


# ------------------------------------------------------------------ listen entries and auth


def test_listen_mappings_tls_auth_and_metrics_token() -> None:
    config = parse_config(
        minimal(
            listen=[
                "unix:///tmp/a.sock",
                {"address": "unix:///run/l/l.sock", "socket_mode": 0o660, "socket_group": "trainers"},
                {"address": "0.0.0.0:7070", "tls": {"cert": "tls/s.crt", "key": "tls/s.key", "client_ca": "tls/ca.crt"}},
                {"address": "10.0.0.1:7071", "insecure": True},
                "[::1]:7072",
                "localhost:7073",
            ],
            auth={"token_file": "tokens.txt"},
            metrics={"require_token": True},
        ),
        Path("/etc/loaderd/ds.yaml"),
    )
    unix, group, tls, insecure, v6, local = config.listen
    assert unix == ListenSpec("unix:///tmp/a.sock") and unix.unix
    assert (group.socket_mode, group.socket_group) == (0o660, "trainers")
    assert tls.tls == TlsSpec(Path("/etc/loaderd/tls/s.crt"), Path("/etc/loaderd/tls/s.key"), Path("/etc/loaderd/tls/ca.crt"))
    assert insecure.insecure and v6.address == "[::1]:7072" and local.address == "localhost:7073"
    assert config.auth is not None and config.auth.token_file == Path("/etc/loaderd/tokens.txt")
    assert config.metrics is not None and config.metrics.require_token


@pytest.mark.parametrize(
    "listen, expect",
    [
        (["0.0.0.0:7070"], "listen: 0.0.0.0:7070 would serve plaintext beyond this host; add tls:"),
        (["loaderd.example:7070"], "would serve plaintext beyond this host"),
        ([{"address": "unix:///a.sock", "tls": {"cert": "c", "key": "k"}}], "listen[0].tls: unix:///a.sock is a unix socket"),
        ([{"address": "1.2.3.4:1", "tls": {"cert": "c"}}], "listen[0].tls: missing required key 'key'"),
        ([{"address": "1.2.3.4:1", "tls": {"cert": "c", "key": "k"}, "insecure": True}], "contradict"),
        ([{"address": "unix:///a.sock", "socket_mode": 0o666}], "must give 'other' users nothing"),
        ([{"address": "127.0.0.1:1", "socket_mode": 0o600}], "apply to unix sockets"),
        ([{"address": "127.0.0.1:1", "tsl": {}}], "listen[0]: unknown key 'tsl'"),
        ([{"tls": {}}], "listen[0]: missing required key 'address'"),
    ],
)
def test_bad_listen_entries_name_the_culprit(listen: list[Any], expect: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(minimal(listen=listen), Path("/etc/loaderd/ds.yaml"))
    assert expect in str(info.value), info.value


@pytest.mark.parametrize(
    "top, expect",
    [
        ({"auth": {}}, "auth: missing required key 'token_file'"),
        ({"auth": {"tokens": "x"}}, "auth: unknown key 'tokens'"),
        ({"metrics": {"require_token": True}}, "metrics.require_token: needs auth.token_file"),
    ],
)
def test_bad_auth_names_the_culprit(top: dict[str, Any], expect: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(minimal(**top), Path("/etc/loaderd/ds.yaml"))
    assert expect in str(info.value), info.value


def test_log_format(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "datasets: {a: {dataset: 'm:A'}}\n")).log_format == "text"
    assert load_config(write(tmp_path, "log_format: json\ndatasets: {a: {dataset: 'm:A'}}\n")).log_format == "json"
    message = config_error(tmp_path, "log_format: xml\ndatasets: {a: {dataset: 'm:A'}}\n")
    assert "log_format" in message and "'xml'" in message and "text, json" in message


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("value", "least", "most"),
    [("4", None, 4), ("auto", 1, "cpus"), ("{min: 2, max: 6}", 2, 6), ("{max: 3}", 1, 3), ("{min: 2}", 2, "cpus"), ("{min: 3, max: 3}", None, 3)],
)  # fmt: skip
def test_workers_fixed_auto_or_bounds(tmp_path: Path, value: str, least: int | None, most: int | str) -> None:
    path = tmp_path / "ds.yaml"
    path.write_text(f"workers: {value}\ndatasets: {{a: {{dataset: 'm:A'}}}}\n")
    config = load_config(path)
    cpus = 4 * usable_cpus()
    assert (config.min_workers, config.workers) == (least, max(cpus, least or 1) if most == "cpus" else most)
    assert config.first_workers == (least or config.workers)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("value", "expect"),
    [("{min: 3, max: 2}", "workers.min: 3 is more than max (2)"), ("{min: 0}", "workers.min: must be at least 1"),
     ("{most: 3}", "workers: unknown key 'most' (allowed: max, min)"), ("{max: two}", "workers.max: expected an integer"),
     ("elastic", "workers: expected an integer, 'auto', or a mapping with 'min' and/or 'max', got str 'elastic'")],
)  # fmt: skip
def test_bad_worker_bounds(tmp_path: Path, value: str, expect: str) -> None:
    message = config_error(tmp_path, f"workers: {value}\ndatasets: {{a: {{dataset: 'm:A'}}}}\n")
    assert message.startswith(expect), message
