"""docs/configuration.md is generated from cluster/config.py (cluster/config_doc.py): the committed
page must be current, every config field must be described, and the example it shows must load."""
from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import ClusterConfig
from cluster.config_doc import DOC_PATH, EXAMPLE_YAML, REGENERATE, main, models, render

ROOT = Path(__file__).resolve().parents[2]
MODELS = [cls for cls, _ in models()]


def test_committed_doc_is_current():
    doc = ROOT / DOC_PATH
    assert doc.is_file(), f"{DOC_PATH} is missing: generate it with `{REGENERATE}` (or `make docs`)"
    assert doc.read_text() == render(), f"{DOC_PATH} is stale: regenerate it with `{REGENERATE}` (or `make docs`)"


def test_walk_reaches_every_nested_model():
    names = {cls.__name__ for cls in MODELS}
    assert {"ClusterConfig", "TransportSettings", "RouterSettings", "PoolConfig", "ResourceShape",
            "EngineSettings"} <= names


@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_every_field_has_a_description(cls):
    missing = [name for name, field in cls.model_fields.items() if not (field.description or "").strip()]
    assert not missing, f"{cls.__name__} fields without a description: {missing}"


def test_every_field_has_a_row():
    text = render()
    for cls in MODELS:
        section = text.split(f"## {cls.__name__}\n", 1)[1].split("\n## ", 1)[0]
        for name in cls.model_fields:
            assert f"| `{name}` |" in section, f"{cls.__name__}.{name} has no row"


def test_example_yaml_loads_and_is_shown_verbatim():
    cfg = ClusterConfig.from_yaml(EXAMPLE_YAML)
    assert cfg.pools
    assert EXAMPLE_YAML.read_text().rstrip() in render()


def test_check_flag(tmp_path, capsys):
    good = tmp_path / "configuration.md"
    good.write_text(render())
    assert main(["--check", str(good)]) == 0
    good.write_text(render() + "\nedited by hand\n")
    assert main(["--check", str(good)]) == 1
    assert REGENERATE in capsys.readouterr().err
