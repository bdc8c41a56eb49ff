"""CUDA/XPU probes through paddle's own APIs (monkeypatched: no such hardware here), and cpu setup."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import paddle
import pytest

from fdplug.plugins import cuda, xpu
from tests.conftest import PYTHON, subprocess_env

GPU_INSTALL = "python -m pip install paddlepaddle-gpu==3.3.1 -i https://www.paddlepaddle.org.cn/packages/stable/cu126/"


def test_cuda_probe_on_the_cpu_build_says_install_paddlepaddle_gpu():
    probe = cuda.probe()
    assert not probe.available
    assert "not compiled with CUDA" in probe.reason and GPU_INSTALL in probe.fix and "cu118" in probe.fix
    assert "fdplug[gpu]" not in probe.fix


def test_every_suggested_gpu_install_is_paddles_own_index():
    """paddlepaddle-gpu 3.x is not on PyPI: no message, extra or line of the docs may suggest `fdplug[gpu]`."""
    import tomllib

    from fdplug.plugin_api.paddle import INSTALL_FIX

    assert GPU_INSTALL in INSTALL_FIX and GPU_INSTALL in cuda.INSTALL_FIX
    root = Path(__file__).resolve().parents[1]
    assert "gpu" not in tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    assert len(pages) > 1 and GPU_INSTALL in pages[0].read_text()
    for page in pages:
        text = page.read_text()
        assert text.count(".[gpu]") == text.count("no `.[gpu]`"), page  # only to say so
    sources = [*pages, *(root / "fdplug").rglob("*.py")]
    assert not [str(f) for f in sources if "fdplug[gpu]" in f.read_text()]


def test_xpu_probe_on_the_cpu_build():
    probe = xpu.probe()
    assert not probe.available and "not compiled with XPU" in probe.reason and "XPU build" in probe.fix


def test_compiled_with_cuda_but_no_device_is_unavailable(monkeypatch):
    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    monkeypatch.setattr(paddle.device.cuda, "device_count", lambda: 0)
    probe = cuda.probe()
    assert not probe.available
    assert probe.reason == "paddle is compiled with CUDA but 0 devices are visible"
    assert "CUDA_VISIBLE_DEVICES" in probe.fix


def test_compiled_with_xpu_but_no_device_is_unavailable(monkeypatch):
    monkeypatch.setattr(paddle, "is_compiled_with_xpu", lambda: True)
    monkeypatch.setattr(paddle.device.xpu, "device_count", lambda: 0)
    probe = xpu.probe()
    assert not probe.available and "0 devices are visible" in probe.reason


def test_device_query_failure_is_reported_not_raised(monkeypatch):
    def broken():
        raise RuntimeError("CUDA driver version is insufficient")

    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    monkeypatch.setattr(paddle.device.cuda, "device_count", broken)
    probe = cuda.probe()
    assert not probe.available and "driver version is insufficient" in probe.reason


def test_cuda_available_only_when_compiled_and_devices_visible(monkeypatch):
    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    monkeypatch.setattr(paddle.device.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(paddle.device.cuda, "get_device_name", lambda i: "NVIDIA H100")
    monkeypatch.setattr(paddle.device.cuda, "get_device_capability", lambda i: (9, 0))
    probe = cuda.probe()
    assert probe.available
    assert probe.info["count"] == "2" and probe.info["capability"] == "9.0"
    assert "NVIDIA H100" in probe.reason


def in_a_fresh_process(code: str, extra_paths: list[str] = (), **env: str):
    """What ``code`` prints last, as JSON, run by a new interpreter (paddle not imported yet)."""
    here = Path(__file__).resolve().parent
    out = subprocess.run([PYTHON, "-c", "import json, sys\n" + code], capture_output=True, text=True, timeout=120,
                         env=subprocess_env(extra_paths=[*extra_paths, str(here.parent)], **env), check=True, cwd=here)
    return json.loads(out.stdout.splitlines()[-1])


def run_setup(**env):
    code = ("import os; from fdplug.plugins.cpu import device; device.setup(); import paddle; "
            "print(json.dumps([str(os.environ.get('MKL_DEBUG_CPU_TYPE')), str(os.environ.get('OMP_NUM_THREADS')), "
            "str(device.cpu_threads())]))")
    return in_a_fresh_process(code, **env)


@pytest.fixture
def clean_thread_env(monkeypatch):
    for name in ("MKL_DEBUG_CPU_TYPE", "OMP_NUM_THREADS", "FDPLUG_CPU_THREADS"):
        monkeypatch.delenv(name, raising=False)


def test_cpu_setup_sets_threads_and_mkl_dispatch_before_paddle(clean_thread_env):
    from fdplug.plugins.cpu.device import is_amd_cpu, usable_cores

    mkl, omp, threads = run_setup()
    assert mkl == ("5" if is_amd_cpu() else "None")
    assert omp == threads == str(usable_cores())


def test_cpu_setup_respects_the_users_settings(clean_thread_env):
    mkl, omp, threads = run_setup(MKL_DEBUG_CPU_TYPE="2", OMP_NUM_THREADS="1")
    assert (mkl, omp, threads) == ("2", "1", "1")
    assert run_setup(FDPLUG_CPU_THREADS="3")[1:] == ["3", "3"]


def test_the_probes_and_selection_leave_paddle_unimported_and_agree_with_it():
    """`fdplug serve`'s API process selects and never imports paddle (~1.5 s of CPU a start): the
    cuda and xpu probes answer from paddle's version file, and give the reasons paddle itself gives."""
    from fdplug.core.plugin_loading.selection import select_components
    from fdplug.plugin_api.paddle import paddle_build_facts

    fresh = in_a_fresh_process(
        "from fdplug.plugins import cuda, xpu\n"
        "from fdplug.core.engine.startup import resolve_engine\n"
        "reasons = [cuda.probe().reason, xpu.probe().reason]\n"
        "device = resolve_engine(None)[2].device.name\n"
        "print(json.dumps([reasons, device, 'paddle' in sys.modules]))")
    facts = paddle_build_facts()
    cpu_build = facts is not None and facts.get("cuda_version") == facts.get("xpu_xre_version") == "False"
    # (here paddle is imported: these probes ask it); a CUDA or XPU build is asked in the fresh one too
    assert fresh == [[cuda.probe().reason, xpu.probe().reason], select_components().device.name, not cpu_build]
    if cpu_build:
        assert f"paddle {paddle.__version__} is not compiled with CUDA" in fresh[0][0]


@pytest.mark.parametrize("cuda_version", ["12.6", "False"])
def test_only_a_build_without_the_device_is_answered_from_the_version_file(tmp_path, cuda_version):
    """A build whose version file names a CUDA version is asked itself (this stand-in says 0 devices);
    one that says 'False' is not imported at all (this one would raise)."""
    package = tmp_path / "paddle"
    (package / "version").mkdir(parents=True)
    (package / "version" / "__init__.py").write_text(f"full_version = '9.9.9'\ncuda_version = '{cuda_version}'\n")
    (package / "__init__.py").write_text(
        "if __import__('paddle.version').version.cuda_version == 'False': raise RuntimeError('imported')\n"
        "__version__ = '9.9.9'\n"
        "def is_compiled_with_cuda(): return True\n"
        "class device:\n    class cuda:\n        device_count = staticmethod(lambda: 0)\n")
    reason = in_a_fresh_process("from fdplug.plugins import cuda\nprint(json.dumps(cuda.probe().reason))",
                                      [str(tmp_path)])
    assert reason == ("paddle 9.9.9 is not compiled with CUDA support" if cuda_version == "False"
                      else "paddle is compiled with CUDA but 0 devices are visible")
