"""RemoteDataLoader's first checks, made before it connects anywhere (no daemon)."""

from __future__ import annotations

import pytest
from support.datasets import Squares

from loaderd import RemoteDataLoader
from loaderd.errors import LoaderdError
from loaderd.wire.limits import IMPORTING_CONFIG_ENV

pytestmark = pytest.mark.timeout(10)


def test_a_dataset_object_is_refused_with_the_yaml_that_names_it() -> None:
    with pytest.raises(TypeError) as info:
        RemoteDataLoader(Squares(4), batch_size=2, address="unix:///nonexistent.sock")  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith("RemoteDataLoader takes the name of a dataset in the daemon's config (a str), not a Squares"), message
    assert "      dataset: support.datasets:Squares\n" in message and 'RemoteDataLoader("train", ...)' in message, message


def test_a_loader_made_while_loaderd_imports_a_config_module_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(IMPORTING_CONFIG_ENV, "train_script")
    with pytest.raises(LoaderdError, match=r"imported module 'train_script', which its config names: .*if __name__ =="):
        RemoteDataLoader("train", address="unix:///nonexistent.sock")
