"""Environment variables: declared by their owner (core, server, each plugin through the contract),
collected in one registry, parsed with clear errors, all in the docs (README.md, docs/); and paddle stays lazy.
And config.json: a key left out means what transformers makes of it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import fdplug.server  # noqa: F401  (declares the server's settings)
from fdplug.core.config import EngineConfig
from fdplug.core.model.checkpoint.architectures import ARCHITECTURES
from fdplug.core.model.checkpoint.config import ModelConfig
from fdplug.core.plugin_loading.loader import load_plugins
from fdplug.core.settings import env
from fdplug.errors import ConfigError, ModelLoadError
from fdplug.plugin_api import hookimpl
from fdplug.plugin_api.settings import SETTINGS, Setting, parse_positive_int
from tests.conftest import PYTHON, subprocess_env


@pytest.fixture
def all_settings() -> dict[str, Setting]:
    """Every setting: the core's and the server's, and what every built-in plugin registers."""
    plugin_set = load_plugins(reload=True)
    assert not plugin_set.failed()
    return dict(SETTINGS)


def test_plugins_declare_their_own_settings_through_the_contract(all_settings):
    from fdplug.core import settings as core_settings

    core_names = {name for name, value in vars(core_settings).items() if isinstance(value, Setting)}
    registered = load_plugins().registry.by_plugin("cpu")["setting"]
    assert "FDPLUG_CPU_KERNELS" in registered and "FDPLUG_CPU_KERNELS" in all_settings
    assert "FDPLUG_BOS_AK" in load_plugins().registry.by_plugin("storage_bos")["setting"]
    assert not core_names & {"FDPLUG_CPU_KERNELS", "FDPLUG_BOS_AK"}
    source = Path(core_settings.__file__).read_text()
    assert "FDPLUG_CPU" not in source and "BOS" not in source, "the core declares a plugin's variable"


def test_a_plugin_setting_is_registered_and_read_and_a_clash_refused(monkeypatch):
    mine = Setting("FDPLUG_TESTCHIP_QUEUES", 2, parse_positive_int, "Queues of the test chip.")

    class Plugin:
        FDPLUG_API_VERSION = "4.0"

        @hookimpl
        def fdplug_register_settings(self, register):
            register(mine)

    class Clash:
        FDPLUG_API_VERSION = "4.0"

        @hookimpl
        def fdplug_register_settings(self, register):
            register(Setting("FDPLUG_PLUGINS", None, str, "a different FDPLUG_PLUGINS"))

    plugin_set = load_plugins(extra=[("testchip", Plugin()), ("clash", Clash())], reload=True)
    assert SETTINGS["FDPLUG_TESTCHIP_QUEUES"] is mine
    monkeypatch.setenv("FDPLUG_TESTCHIP_QUEUES", "5")
    assert mine.value() == 5 and env("FDPLUG_TESTCHIP_QUEUES") == 5
    assert plugin_set.infos["clash"].status == "failed" and "FDPLUG_PLUGINS" in plugin_set.infos["clash"].error
    SETTINGS.pop("FDPLUG_TESTCHIP_QUEUES")


def test_bad_values_name_the_variable_and_the_fix(monkeypatch, all_settings):
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


def test_every_variable_is_in_the_docs(all_settings):
    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    assert root / "docs" / "configuration.md" in pages
    text = "\n".join(page.read_text() for page in pages)
    missing = [name for name in all_settings if f"`{name}`" not in text]
    assert not missing, f"document these in docs/configuration.md's table: {missing}"
    assert all(setting.help.strip() for setting in all_settings.values())


# --------------------------------------------------------------------------------------------------
# config.json keys left out: what transformers makes of them (tests/fixtures/config_defaults.json,
# written by tools/make_config_defaults.py from transformers' own config classes)
# --------------------------------------------------------------------------------------------------

DEFAULTS = json.loads((Path(__file__).parent / "fixtures" / "config_defaults.json").read_text())
_LEFT_OUT = [(arch, key) for arch, entry in DEFAULTS["architectures"].items() for key in ["", *entry["left_out"]]]


def _facts(cfg: ModelConfig) -> dict:
    """The fixture's quantities, as fdplug parsed them."""
    out = {"head_dim": cfg.head_dim, "num_kv_heads": cfg.num_kv_heads, "rope_theta": cfg.rope.theta,
           "partial_rotary": cfg.rope.partial, "rms_norm_eps": cfg.rms_norm_eps,
           "max_positions": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
           "qkv_bias": cfg.attention_bias, "o_bias": cfg.o_proj_bias,
           "mlp_bias": cfg.mlp_bias, "qk_norm": cfg.qk_norm}
    if cfg.moe is not None:
        routing = cfg.moe.routing
        out |= {"num_experts": cfg.moe.num_experts, "moe_intermediate_size": cfg.moe.intermediate_size,
                "top_k": routing.top_k, "renormalize": routing.renormalize, "moe_layers": list(cfg.moe.layers),
                "shared_intermediate_size": cfg.moe.shared_intermediate_size, "shared_gate": cfg.moe.shared_gate,
                "routed_scaling": routing.scaling, "num_groups": routing.num_groups,
                "topk_groups": routing.topk_groups, "norm_floor": routing.norm_floor}
        if cfg.moe.vision is not None:
            out |= {"vision_experts": cfg.moe.vision.num_experts,
                    "vision_intermediate_size": cfg.moe.vision.intermediate_size}
    if cfg.rope.mrope_section:
        out["mrope_section"] = list(cfg.rope.mrope_section)
    return out


def _left_out(entry: dict, key: str) -> dict:
    """The entry's config.json without ``key``: out of its ``text_config`` if the entry lists it there."""
    config = json.loads(json.dumps(entry["config"]))
    (config["text_config"] if key in entry.get("text_config_keys", ()) else config).pop(key, None)
    return config


def test_the_defaults_fixture_covers_every_architecture():
    assert set(DEFAULTS["architectures"]) == set(ARCHITECTURES)


@pytest.mark.parametrize("arch, key", _LEFT_OUT, ids=[f"{arch}-{key or 'full'}" for arch, key in _LEFT_OUT])
def test_a_key_left_out_means_what_transformers_makes_of_it(arch, key, tmp_path):
    """Each key fdplug reads with a default, left out of a config.json that sets all of them to
    non-default values: fdplug's reading equals transformers' (ERNIE-4.5-MoE's head_dim is
    hidden_size // heads, dense ERNIE-4.5's 128; Qwen2's num_key_value_heads 32, ...)."""
    entry = DEFAULTS["architectures"][arch]
    (tmp_path / "config.json").write_text(json.dumps(_left_out(entry, key)))
    expected = entry["facts"] | (entry["left_out"][key] if key else {})
    got = _facts(ModelConfig.from_dir(tmp_path))
    assert {name: got[name] for name in expected} == expected, f"transformers {DEFAULTS['transformers']}"


def test_an_absent_num_key_value_heads_that_cannot_be_is_named():
    raw = DEFAULTS["architectures"]["Qwen2ForCausalLM"]["config"] | {"num_attention_heads": 8, "hidden_size": 512}
    del raw["num_key_value_heads"]
    with pytest.raises(ModelLoadError, match="no 'num_key_value_heads'.*default.*is 32") as err:
        ModelConfig.from_dict(raw)
    assert "add num_key_value_heads" in err.value.fix
