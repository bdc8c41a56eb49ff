"""Selection: strict explicit devices, explicit > priority > name, reasons, round trip by names."""

from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest

from fdplug import hookimpl
from fdplug.core.config import EngineConfig
from fdplug.core.plugin_loading.loader import load_plugins
from fdplug.core.plugin_loading.selection import select_components
from fdplug.errors import DeviceUnavailableError, SelectionError, UnknownComponentError
from fdplug.plugin_api.engine_config import ModelTraits
from fdplug.plugin_api.specs import (
    DeviceSpec,
    FeatureStorageSpec,
    ModelRunnerSpec,
    MoEBackendSpec,
    Probe,
)
from tests.conftest import PYTHON, subprocess_env, write_dist
from tests.test_plugin_loading import AttnPlugin, attention_spec


class DevicePlugin:
    FDPLUG_API_VERSION = "4.0"

    def __init__(self, *devices):
        self.devices = devices

    @hookimpl
    def fdplug_register_devices(self, register):
        for spec in self.devices:
            register(spec)


def device(name, available=True, priority=0, probe=None):
    return DeviceSpec(name=name, paddle_device="cpu", priority=priority,
                      probe=probe or (lambda: Probe(available, f"{name} probe says {available}", fix=f"fix {name}")))


def test_auto_picks_cpu_here_and_says_why_the_others_were_rejected():
    selection = select_components("auto")
    assert selection.device.name == "cpu"
    reasons = {d.name: d for d in selection.decisions if d.role == "device"}
    assert reasons["cpu"].chosen and "highest priority" in reasons["cpu"].reason
    assert not reasons["cuda"].chosen and "not compiled with CUDA" in reasons["cuda"].reason
    assert not reasons["xpu"].chosen and "not compiled with XPU" in reasons["xpu"].reason
    assert "rejected xpu" in selection.explain()


def test_explicit_unavailable_device_is_an_error_with_reason_and_fix():
    with pytest.raises(DeviceUnavailableError) as err:
        select_components("xpu")
    assert "not compiled with XPU support" in err.value.message
    assert "XPU build" in err.value.fix
    assert err.value.decisions and not err.value.decisions[0].chosen


def test_explicit_device_never_falls_back():
    plugin_set = load_plugins(extra=[("dev", DevicePlugin(device("gone", available=False, priority=1000)))])
    with pytest.raises(DeviceUnavailableError, match="gone"):
        select_components("gone", plugins=plugin_set)
    assert select_components("auto", plugins=plugin_set).device.name == "cpu"


def test_auto_prefers_the_highest_priority_available_device():
    plugin_set = load_plugins(extra=[("dev", DevicePlugin(device("fast", priority=50), device("faster", False, 60)))])
    selection = select_components(plugins=plugin_set)
    assert selection.device.name == "fast"
    cpu = next(d for d in selection.decisions if d.name == "cpu")
    assert "priority 0 is below fast's 50" in cpu.reason


def test_unknown_device_lists_known_ones_and_failed_plugins(site):
    write_dist(site, "fdplug-mychip", "0.1", {"mychip": "fdplug_mychip"},
               {"fdplug_mychip": "raise ImportError('libmychip.so: cannot open shared object file')\n"})
    with pytest.raises(UnknownComponentError) as err:
        select_components("mychip")
    message = str(err.value)
    assert "known: cpu, cuda, xpu" in message
    assert "libmychip.so: cannot open shared object file" in message


def test_probe_that_raises_means_unavailable_not_a_crash():
    def explode():
        raise OSError("driver hung")

    plugin_set = load_plugins(extra=[("dev", DevicePlugin(device("flaky", priority=99, probe=explode)))])
    selection = select_components(plugins=plugin_set)
    flaky = next(d for d in selection.decisions if d.name == "flaky")
    assert selection.device.name == "cpu" and "OSError: driver hung" in flaky.reason


def builtin_cpu_attention() -> str:
    """What the built-in plugins alone pick on cpu: cpu_native where its kernels build, else reference."""
    from fdplug.plugins.cpu import kernels

    return "reference" if kernels.unavailable_reason() else "cpu_native"


def test_priority_beats_name_and_name_breaks_ties():
    plugin_set = load_plugins(extra=[("p", AttnPlugin(attention_spec("zeta", priority=50),
                                                      attention_spec("alpha", priority=50),
                                                      attention_spec("omega", priority=1)))])
    selection = select_components(plugins=plugin_set)
    assert selection.attention.name == "alpha"
    reasons = {d.name: d.reason for d in selection.decisions if d.role == "attention"}
    assert "same priority as alpha" in reasons["zeta"]
    assert "priority 1 is below alpha's 50" in reasons["omega"]


def test_explicit_component_beats_priority():
    plugin_set = load_plugins(extra=[("p", AttnPlugin(attention_spec("turbo", priority=100)))])
    assert select_components(plugins=plugin_set).attention.name == "turbo"
    selection = select_components(attention="reference", plugins=plugin_set)
    assert selection.attention.name == "reference"
    assert any(d.name == "turbo" and "asked for explicitly" in d.reason for d in selection.decisions)


def test_components_for_other_devices_or_unsupported_configs_are_rejected_with_reasons():
    no_gqa = attention_spec("mha_only", priority=50,
                            supports=lambda c: "needs num_kv_heads == num_heads"
                            if c.model and c.model.num_kv_heads != c.model.num_attention_heads else None)
    plugin_set = load_plugins(extra=[("p", AttnPlugin(attention_spec("gpu_only", devices=("cuda",), priority=90),
                                                      no_gqa))])
    config = EngineConfig(model=ModelTraits(num_attention_heads=8, num_kv_heads=2))
    selection = select_components(config=config, plugins=plugin_set)
    reasons = {d.name: d.reason for d in selection.decisions if d.role == "attention"}
    assert selection.attention.name == builtin_cpu_attention()
    assert "not on the selected device 'cpu'" in reasons["gpu_only"]
    assert reasons["mha_only"] == "needs num_kv_heads == num_heads"
    with pytest.raises(SelectionError, match="'gpu_only' was asked for explicitly but cannot be used"):
        select_components(attention="gpu_only", plugins=plugin_set)
    assert select_components(attention="mha_only", plugins=plugin_set).attention.name == "mha_only"


def test_supports_that_raises_is_a_rejection():
    def boom(config):
        raise ZeroDivisionError("bad math")

    plugin_set = load_plugins(extra=[("p", AttnPlugin(attention_spec("crashy", priority=9, supports=boom)))])
    selection = select_components(plugins=plugin_set)
    assert selection.attention.name == builtin_cpu_attention()
    assert any("ZeroDivisionError: bad math" in d.reason for d in selection.decisions if d.name == "crashy")


def test_moe_weight_format_must_match_the_model():
    class W4Plugin:
        FDPLUG_API_VERSION = "4.0"

        @hookimpl
        def fdplug_register_moe_backends(self, register):
            register(MoEBackendSpec(name="w4", devices=("*",), factory=lambda c: None, priority=5,
                                    weight_formats=("w4a8",)))

    plugin_set = load_plugins(extra=[("w4", W4Plugin())])
    plain = select_components(config=EngineConfig(model=ModelTraits(num_experts=8)), plugins=plugin_set)
    assert plain.moe.name == "cpu_native"     # the plain-float backends outrank w4 (5) on a plain model
    quantized = select_components(config=EngineConfig(model=ModelTraits(moe_weight_format="w4a8")),
                                  plugins=plugin_set)
    assert quantized.moe.name == "w4"
    assert all("not the model's 'w4a8'" in d.reason for d in quantized.decisions
               if d.role == "moe" and d.name in ("reference", "cpu_native"))
    fp8 = select_components(config=EngineConfig(model=ModelTraits(moe_weight_format="fp8_block")),
                            plugins=plugin_set)
    assert fp8.moe.name == "cpu_native"       # both cpu backends execute fp8_block; w4 does not
    assert any("not the model's 'fp8_block'" in d.reason for d in fp8.decisions if d.role == "moe" and d.name == "w4")


def test_linear_weight_format_must_match_the_runner():
    """A runner executes the model's linear layers: one that runs float linears only (the default for
    a `ModelRunnerSpec`) is passed over for an FP8 model, with the reason; the core's runs both."""
    class FloatRunner:
        FDPLUG_API_VERSION = "4.0"

        @hookimpl
        def fdplug_register_model_runners(self, register):
            register(ModelRunnerSpec(name="graphs", devices=("*",), factory=lambda c, s: None, priority=5))

    plugin_set = load_plugins(extra=[("graphs", FloatRunner())])
    assert select_components(config=EngineConfig(model=ModelTraits()), plugins=plugin_set).runner.name == "graphs"
    fp8 = select_components(config=EngineConfig(model=ModelTraits(linear_weight_format="fp8_block")),
                            plugins=plugin_set)
    assert fp8.runner.name == "default"
    rejected = next(d for d in fp8.decisions if d.role == "runner" and d.name == "graphs")
    assert rejected.reason == "executes weight formats none, not the model's 'fp8_block'"
    with pytest.raises(SelectionError, match="not the model's 'fp8_block'"):
        select_components(runner="graphs", config=EngineConfig(model=ModelTraits(linear_weight_format="fp8_block")),
                          plugins=plugin_set)


def test_a_plugin_that_registers_only_a_device_gets_the_portable_components():
    """With the cpu plugin denied, a bare device still gets a runner, attention, MoE and op kernels:
    the core registers them for every device."""
    plugin_set = load_plugins(deny=["cpu"], extra=[("dev", DevicePlugin(device("solo")))])
    selection = select_components(plugins=plugin_set)
    assert selection.device.name == "solo"
    chosen = {d.role: d.plugin for d in selection.decisions if d.chosen and d.role != "storage"}
    assert chosen == {"device": "dev", "runner": "core", "attention": "core", "moe": "core", "op:swiglu": "core",
                      "op:rms_norm": "core", "op:fp8_linear": "core", "op:linear": "core", "op:add_rms_norm": "core",
                      "op:rope": "core", "op:argmax": "core", "op:gguf_linear": "core", "op:decoder_stack": "core",
                      "op:vision_attention": "core"}
    assert load_plugins(deny=["core"]).infos["core"].status == "loaded"   # the core's cannot be disabled


def test_no_candidate_left_is_an_error_listing_every_reason():
    config = EngineConfig(model=ModelTraits(num_experts=8, moe_weight_format="w4a8"))
    with pytest.raises(SelectionError) as err:
        select_components("cpu", config=config)
    assert "no moe can run on device 'cpu'" in str(err.value)
    assert "reference: executes weight formats none, fp8_block, gguf, not the model's 'w4a8'" in str(err.value)


def test_storages_are_chosen_per_scheme_by_priority_and_explicitly():
    class Stores:
        FDPLUG_API_VERSION = "4.0"

        @hookimpl
        def fdplug_register_feature_storages(self, register):
            register(FeatureStorageSpec(name="s3ish", schemes=("s3", "mem"), factory=lambda c: None, priority=1))
            register(FeatureStorageSpec(name="memfast", schemes=("mem",), factory=lambda c: None, priority=9))

    plugin_set = load_plugins(extra=[("stores", Stores())])
    selection = select_components(plugins=plugin_set)
    assert selection.storages["mem"].name == "memfast" and selection.storages["s3"].name == "s3ish"
    assert select_components(storages={"mem": "s3ish"}, plugins=plugin_set).storages["mem"].name == "s3ish"
    with pytest.raises(SelectionError, match="handles mem"):
        select_components(storages={"s3": "memfast"}, plugins=plugin_set)


def test_backend_is_immutable():
    selection = select_components()
    with pytest.raises(dataclasses.FrozenInstanceError):
        selection.device = None
    with pytest.raises(TypeError):
        selection.storages["x"] = None


def test_names_rebuild_the_same_choice_in_another_process():
    names = select_components(attention="reference").to_names()
    code = ("import json, sys, fdplug; names = json.loads(sys.argv[1]); "
            "print(json.dumps(fdplug.select_components(**names).to_names()))")
    out = subprocess.run([PYTHON, "-c", code, json.dumps(names)], capture_output=True, text=True, timeout=120,
                         env=subprocess_env(), check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == names


def test_fd_moe_backend_names_the_moe_backend_and_the_flag_wins(monkeypatch):
    monkeypatch.setenv("FD_MOE_BACKEND", "reference")
    chosen = select_components("cpu")
    assert chosen.moe.name == "reference"
    assert any(d.chosen and d.reason == "asked for FD_MOE_BACKEND" for d in chosen.decisions if d.role == "moe")
    assert select_components("cpu", moe="cpu_native").moe.name == "cpu_native"
    monkeypatch.setenv("FD_MOE_BACKEND", "cutlass")          # FastDeploy's GPU kernels are not fdplug's
    with pytest.raises(UnknownComponentError,
                       match="no moe named 'cutlass'.*known: blackwell_fp8, cpu_native, reference"):
        select_components("cpu")
