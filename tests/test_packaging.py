"""What the wheel carries: pyproject's package list names every package of the source tree, and the YAML that
`checkpointless-train` composes is found where a wheel puts it (`scripts/wheel_check.sh` installs a real wheel and
runs every console script from it)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_lists_every_package_of_the_source_tree() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "nemo_checkpointless").rglob("__init__.py")}
    assert found - listed == set(), f"add to [tool.setuptools] packages in pyproject.toml: {sorted(found - listed)}"
    mapped = {name: ROOT / folder for name, folder in setuptools["package-dir"].items() if name}
    assert listed - found == set(mapped), (sorted(listed - found), sorted(mapped))
    for name, folder in mapped.items():
        assert sorted(folder.glob("*.yaml")), f"{name} maps to {folder}, which holds no YAML"


def test_the_yaml_is_read_from_the_installed_package_before_the_checkout(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from nemo_checkpointless.cli import compose

    assert compose.conf_dir() == ROOT / "conf" and compose.recipes_dir() == ROOT / "recipes"  # this checkout
    package = tmp_path / "nemo_checkpointless"
    (package / "_conf").mkdir(parents=True)
    (package / "_recipes").mkdir()
    monkeypatch.setattr(compose, "_PKG_ROOT", package)  # laid out as a wheel installs it
    assert compose.conf_dir() == package / "_conf" and compose.recipes_dir() == package / "_recipes"
