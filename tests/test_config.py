"""Environment variables are declared once, parsed with clear errors, and paddle stays lazy."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from fdplug.core.config import ENV_VARS, EngineConfig, env
from fdplug.errors import ConfigError
from tests.conftest import PYTHON, subprocess_env


def test_every_variable_is_documented():
    for var in ENV_VARS.values():
        assert var.help.strip(), var.name


def test_bad_values_name_the_variable_and_the_fix(monkeypatch):
    monkeypatch.setenv("FDPLUG_CPU_THREADS", "0")
    with pytest.raises(ConfigError) as err:
        env("FDPLUG_CPU_THREADS")
    assert "FDPLUG_CPU_THREADS='0' is invalid: must be >= 1" in str(err.value) and err.value.fix


def test_lists_and_flags_parse(monkeypatch):
    monkeypatch.setenv("FDPLUG_DISABLE_PLUGINS", " a, b ,,c")
    monkeypatch.setenv("FDPLUG_STRICT_PLUGINS", "yes")
    assert env("FDPLUG_DISABLE_PLUGINS") == ("a", "b", "c") and env("FDPLUG_STRICT_PLUGINS") is True


@pytest.mark.parametrize("kwargs, message", [({"block_size": 12}, "power of two"),
                                             ({"fetch_timeout": 0}, "fetch_timeout")])
def test_engine_config_validates(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kwargs)


def test_import_fdplug_and_loading_plugins_do_not_import_paddle():
    code = ("import sys, fdplug; ps = fdplug.load_plugins(); "
            "assert 'paddle' not in sys.modules, 'paddle imported'; print(len(ps.plugins()))")
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60, env=subprocess_env())
    assert out.returncode == 0, out.stderr


def test_every_variable_is_in_the_readme():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    missing = [name for name in ENV_VARS if f"`{name}`" not in readme]
    assert not missing, f"document these in README.md: {missing}"
