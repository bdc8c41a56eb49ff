"""The CLI as a user runs it: the real console script in a subprocess, real entry points."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fdplug
from tests.conftest import install_example_plugin, subprocess_env, write_dist

FDPLUG = str(Path(sys.executable).parent / "fdplug")  # the console script pip installed beside this python


def run(*args: str, paths: list[str] = (), **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([FDPLUG, *args], capture_output=True, text=True, timeout=120,
                          env=subprocess_env(list(paths), **env))


def test_version():
    out = run("--version")
    assert out.returncode == 0 and fdplug.__version__ in out.stdout


def test_plugins_lists_builtins_with_status():
    out = run("plugins")
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines()[2:] if line.strip()}
    assert "loaded" in lines["cpu"] and "device: cpu" in lines["cpu"]
    assert "loaded" in lines["cuda"] and "builtin" in lines["cuda"]


def test_plugins_shows_the_example_and_a_broken_plugin_and_still_exits_0(tmp_path):
    site = tmp_path / "site"
    paths = install_example_plugin(site)
    write_dist(site, "fdplug-broken", "0.0.1", {"broken": "fdplug_broken"},
               {"fdplug_broken": "raise ImportError('no libbroken.so')\n"})
    out = run("plugins", "--json", paths=paths)
    assert out.returncode == 0, out.stderr
    plugins = {p["name"]: p for p in json.loads(out.stdout)["plugins"]}
    assert plugins["fakechip"]["status"] == "loaded"
    assert plugins["fakechip"]["source"] == "distribution fdplug-fakechip"
    assert plugins["fakechip"]["registered"] == {"device": ["fakechip"]}
    assert plugins["broken"]["status"] == "failed" and "no libbroken.so" in plugins["broken"]["error"]
    table = run("plugins", paths=paths).stdout
    assert "broken" in table and "failed" in table and "fakechip" in table


def test_explain_auto_picks_cpu_and_says_why():
    out = run("explain", "--device", "auto")
    assert out.returncode == 0, out.stderr
    assert "chosen   cpu" in out.stdout and "highest priority" in out.stdout
    assert "rejected cuda" in out.stdout and "selected: device=cpu" in out.stdout


def test_explain_xpu_fails_with_the_probes_reason_and_the_fix():
    out = run("explain", "--device", "xpu")
    assert out.returncode == 1
    assert "error: device 'xpu' was asked for explicitly but is not available" in out.stderr
    assert "not compiled with XPU support" in out.stderr and "fix: install paddle's XPU build" in out.stderr
    assert "Traceback" not in out.stderr


def test_explain_a_bare_device_gets_the_core_components(tmp_path):
    out = run("explain", "--device", "fakechip", "--json", paths=install_example_plugin(tmp_path / "site"),
              FDPLUG_DISABLE_PLUGINS="cpu")
    assert out.returncode == 0, out.stderr
    names = json.loads(out.stdout)
    assert names["device"] == "fakechip" and names["attention"] == "reference"
    assert names["moe"] == "reference" and names["runner"] == "default"
    assert names["ops"] == {"swiglu": "paddle_swiglu", "rms_norm": "paddle_rms_norm",
                            "fp8_linear": "paddle_fp8_linear", "linear": "paddle_linear",
                            "add_rms_norm": "paddle_add_rms_norm", "rope": "paddle_rope", "argmax": "paddle_argmax",
                            "gguf_linear": "paddle_gguf_linear", "decoder_stack": "paddle_layer_by_layer",
                            "vision_attention": "paddle_vision_attention"}


def test_explain_unknown_component_exits_nonzero():
    out = run("explain", "--attention", "warp-speed")
    assert out.returncode == 1 and "no attention named 'warp-speed'" in out.stderr


@pytest.mark.parametrize("swiglu", ["paddle_swiglu", "cpu_native_swiglu"])
def test_generate_runs_the_components_named_on_the_command_line(swiglu):
    out = run("generate", "--runner", "default", "--op-kernel", f"swiglu={swiglu}", "--prompt", "Hello",
              "--max-tokens", "4", "--max-model-len", "256", "--num-kv-blocks", "64")
    assert out.returncode == 0, out.stderr
    assert "runner=default " in out.stderr and f"swiglu:{swiglu}" in out.stderr
    # the text it streams is what the offline API generates with the same components and parameters
    llm = fdplug.LLM(runner="default", op_kernels={"swiglu": swiglu}, max_model_len=256, num_kv_blocks=64)
    [expected] = llm.generate("Hello", fdplug.SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert len(expected.outputs[0].token_ids) == 4
    assert out.stdout == expected.outputs[0].text + "\n"


def test_generate_says_why_an_output_is_empty_and_suggests_chat():
    """The demo chat model ends at once on a raw prompt: stdout stays the (empty) text, stderr says why."""
    flags = ("--prompt", "Hello, how are you?", "--max-model-len", "256", "--num-kv-blocks", "64")
    out = run("generate", *flags)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "\n"
    assert "[finish_reason=stop, 1 token]" in out.stderr and "try --chat" in out.stderr
    chat = run("generate", "--chat", "--max-tokens", "4", *flags)
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.strip() and "[finish_reason=length, 4 tokens]" in chat.stderr and "--chat" not in chat.stderr


def test_a_malformed_op_kernel_flag_is_a_usage_error():
    out = run("generate", "--op-kernel", "swiglu", "--prompt", "Hello")
    assert out.returncode == 2 and "OP=NAME" in out.stderr and "Traceback" not in out.stderr


def test_unknown_runner_is_a_clear_error():
    out = run("generate", "--runner", "warp-speed", "--prompt", "Hello")
    assert out.returncode == 1 and "warp-speed" in out.stderr and "Traceback" not in out.stderr


def test_serve_help_states_the_engines_kv_cache_default():
    """The --kv-cache-memory default in the help is the size the engine plans when it is left out."""
    from fdplug.core.config import EngineConfig
    from fdplug.core.worker.kv_cache import plan_kv_cache
    from fdplug.plugin_api.model_runner import GIB

    out = run("serve", "--help")
    assert out.returncode == 0, out.stderr
    stated = re.search(r"--kv-cache-memory FLOAT +KV cache size in GiB \(default: ([0-9.]+), capped at what "
                       r"--max-num-seqs requests", " ".join(out.stdout.split()))
    assert stated, out.stdout
    size, per_block = float(stated.group(1)), 64 << 10
    for max_model_len in (512, 16384):   # capped by max_num_seqs requests of max_model_len, and not
        default = plan_kv_cache(EngineConfig(), per_block, max_model_len, None, 0)
        assert default == plan_kv_cache(EngineConfig(kv_cache_memory=size), per_block, max_model_len, None, 0)
    assert default.total_bytes == size * GIB


def test_doctor_reports_paddle_devices_and_threads():
    out = run("doctor", FDPLUG_CPU_THREADS="2")
    assert out.returncode == 0, out.stderr
    assert "paddle 3." in out.stdout and "cuda=False" in out.stdout
    assert "cpu      available" in out.stdout and "xpu      unavailable" in out.stdout
    assert "2 compute threads" in out.stdout and "FDPLUG_CPU_THREADS=2" in out.stdout


def test_bad_environment_value_is_a_clear_error():
    out = run("plugins", FDPLUG_STRICT_PLUGINS="maybe")
    assert out.returncode == 1
    assert "FDPLUG_STRICT_PLUGINS='maybe' is invalid" in out.stderr and "Traceback" not in out.stderr


def test_a_prefill_instance_with_no_preparation_threads_exits_at_startup():
    """FastDeploy's FD_PREFILL_PREPARE_REQ_THREAD_NUM=0 stalls its engine; here it is refused first."""
    out = run("serve", "--role", "prefill", "--port", "0", FD_PREFILL_PREPARE_REQ_THREAD_NUM="0")
    assert out.returncode == 1
    assert "FD_PREFILL_PREPARE_REQ_THREAD_NUM='0' is invalid" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("device", ["cpu", "fakechip"])
def test_conformance_kit_passes(device, tmp_path):
    """The kit as a third-party author runs it: pytest --pyargs fdplug.testing --fdplug-device NAME."""
    paths = install_example_plugin(tmp_path / "site") if device == "fakechip" else []
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "fdplug.testing",
                          "--fdplug-device", device], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env=subprocess_env(paths))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout
