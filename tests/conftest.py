"""Shared test helpers: a clean plugin environment and throwaway installed distributions."""

from __future__ import annotations

import compileall
import json
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fdplug.plugins.cpu.device import usable_cores

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_PLUGIN = REPO / "examples" / "fdplug-fakechip"   # docs/plugins.md's "Writing a plugin"


# The engines in tests run the linear kernel chosen by priority on every shape (FDPLUG_OP_TIMING=0):
# timed, a shape whose figures near-tie could go to paddle's matmul on one run and not the next, and
# paddle's results depend on the batch (MKL picks its kernel by the row count), so the tests of batch
# invariance and of tokens across processes would hang on timing noise. The timing has its own tests
# (tests/test_op_timing.py, with FDPLUG_OP_TIMING=1), the engine with a plan included.
PINNED_KERNELS = {"FDPLUG_OP_TIMING": "0"}
os.environ.update(PINNED_KERNELS)   # at import: module- and session-scoped fixtures build engines too


def pytest_configure(config) -> None:
    """The sources compiled to bytecode once, before any test starts a process: where
    PYTHONDONTWRITEBYTECODE is set (as on this project's CI machines) no import writes a .pyc, and an
    editable install's modules are otherwise compiled again by every server, engine, rank and CLI
    call a test starts (~0.7 s a server start, AMD EPYC, avx2-or-less). Elsewhere nearly a no-op."""
    if "PYTEST_XDIST_WORKER" not in os.environ:   # (the controller, or the one process)
        compileall.compile_dir(REPO / "fdplug", quiet=1)
        compileall.compile_dir(REPO / "tests", quiet=1)


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (the README: every core): a worker a core, at most 4 (past that the servers and
    Ray each worker starts would want more memory than they gain). On CI's 2 cores: 952 s in one
    process, 560 s on 2 workers with the threads and order below (a third worker gained nothing)."""
    return max(1, min(4, usable_cores()))


def xdist_worker() -> tuple[int, int]:
    """(this pytest-xdist worker's index, the number of workers): gwN of ``PYTEST_XDIST_WORKER_COUNT``;
    (0, 1) in one process."""
    return (int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")),
            int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


# Under pytest-xdist the workers share the cores: an engine or server a test starts computes on its
# worker's share (FDPLUG_CPU_THREADS, which spawned servers inherit), unless the developer set it. Each
# taking every core oversubscribed them: 1,264 worker-seconds against 1,001 on 2 workers and 2 cores.
# The kernels' own tests pass their thread counts explicitly, so the threaded paths are still run.
if "PYTEST_XDIST_WORKER" in os.environ and "FDPLUG_CPU_THREADS" not in os.environ:
    os.environ["FDPLUG_CPU_THREADS"] = str(max(1, usable_cores() // xdist_worker()[1]))


HEAVY_FIRST = frozenset({
    "test_cli", "test_connection_guard", "test_cpu_isa", "test_device_probes", "test_expert_parallel",
    "test_fault_containment", "test_fp8_models", "test_fuzz_server", "test_hostile_clients", "test_kv_peers",
    "test_llm_api", "test_moe_golden", "test_moe_models", "test_server_agent", "test_server_api", "test_server_dp",
    "test_server_dp_ray", "test_server_ep", "test_server_generation", "test_server_lifecycle",
    "test_server_multimodal", "test_server_pd", "test_server_vision", "test_smollm2", "test_step_recovery",
    "test_structured_outputs",
})
"""Modules whose tests start servers, processes or real models (seconds a test; ~85% of the suite's
time). They run first, so that pytest-xdist spreads them over the workers and the short tests even
out the end: in file order a worker was left with them while the other sat idle for 76-150 s."""


def pytest_collection_modifyitems(config, items) -> None:
    if "PYTEST_XDIST_WORKER" in os.environ:   # (in one process the order changes nothing)
        items.sort(key=lambda item: item.path.stem not in HEAVY_FIRST)   # (stable: each module's order kept)


@pytest.fixture(autouse=True)
def _clean_plugin_env(monkeypatch):
    """No test sees the developer's FDPLUG_* plugin settings, nor a previous test's loaded set."""
    for name in ("FDPLUG_PLUGINS", "FDPLUG_DISABLE_PLUGINS", "FDPLUG_STRICT_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    from fdplug.core.plugin_loading import loader as plugins

    plugins._cache.clear()
    monkeypatch.setattr(plugins, "_current", None)
    yield
    plugins._cache.clear()


@pytest.fixture(scope="module", autouse=True)
def _no_server_outlives_its_module():
    """Every ``fdplug`` process a module's tests started (tests/serverkit.spawn) ends with the module,
    even where a fixture failed halfway and never reached its own stop: a server left running takes
    the 2 cores from every test after it. (Autouse, so set up first and torn down last: the module's
    own fixtures stop their servers before this looks.)"""
    yield
    from tests.serverkit import stop_leftovers

    left = stop_leftovers()
    if left:
        print(f"\nstopped {len(left)} fdplug process(es) their tests left running: {left}")


def write_dist(site: Path, dist: str, version: str, entry_points: dict[str, str],
               modules: dict[str, str] | None = None) -> Path:
    """Install a distribution the way pip leaves it: a ``.dist-info`` with METADATA and entry points.

    Discovery then goes through the real ``importlib.metadata`` entry-point machinery.
    """
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[fdplug]\n{lines}\n")
    for module, source in (modules or {}).items():
        (site / f"{module}.py").write_text(textwrap.dedent(source))
    return site


def install_example_plugin(site: Path) -> list[str]:
    """The fakechip example plugin as installed: its dist-info from its pyproject, its package on the path."""
    import tomllib

    meta = tomllib.loads((EXAMPLE_PLUGIN / "pyproject.toml").read_text())["project"]
    write_dist(site, meta["name"], meta["version"], meta["entry-points"]["fdplug"])
    return [str(site), str(EXAMPLE_PLUGIN)]


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    """A fresh site directory at the front of sys.path."""
    path = tmp_path / "site"
    path.mkdir()
    monkeypatch.syspath_prepend(str(path))
    return path


def subprocess_env(extra_paths: list[str] = (), **env: str) -> dict[str, str]:
    """This environment for a child process: no FDPLUG_* setting of the developer's, the kernels
    pinned (PINNED_KERNELS), then ``env``."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("FDPLUG_")}
    out["PYTHONPATH"] = os.pathsep.join([*extra_paths, *filter(None, [out.get("PYTHONPATH")])])
    out.update(PINNED_KERNELS)
    out.update(env)
    return out


PYTHON = sys.executable
GOLDEN = REPO / "tests" / "fixtures" / "golden"   # tools/make_golden.py: tiny HF models + their logits


def golden(name: str) -> tuple[list[list[int]], list[np.ndarray]]:
    """A golden fixture's token sequences and transformers' float32 logits for each."""
    seqs = json.loads((GOLDEN / name / "golden.json").read_text())["sequences"]
    return seqs, [np.load(GOLDEN / name / f"logits_{i}.npy") for i in range(len(seqs))]



def write_test_model(out_dir: Path, **overrides) -> Path:
    """A small Qwen2-architecture model with the demo tokenizer and sharper random weights.

    The demo's N(0, 0.02) weights make greedy decoding repeat one token, which would hide attention
    bugs; a larger init makes the next token depend on the whole context.
    """
    from fdplug.demo import random_model as demo

    out_dir.mkdir(parents=True, exist_ok=True)
    demo.write_random_model(out_dir, **{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                      "num_attention_heads": 4, "num_key_value_heads": 2,
                                      "initializer_range": 0.25, **overrides})
    return out_dir


@pytest.fixture(scope="session")
def test_model_dir(tmp_path_factory) -> Path:
    return write_test_model(tmp_path_factory.mktemp("models") / "sharp")


def kernel_wins(case, *args) -> dict[str, list]:
    """A startup timing's figures (`row_op_timing._time_case`, `backend_timing._time_case`) in which
    the kernel is twice as fast as the portable op at each of the case's rows: tests that compare
    engines pin a tiny model's near ties with it."""
    return {"rows": list(case.rows), "kernel": [1.0] * len(case.rows), "portable": [2.0] * len(case.rows)}


def explain_measuring(model: Path, cache: Path, monkeypatch, *args: str) -> str:
    """``fdplug explain --model MODEL ARGS`` with the startup timing on (the tests' default pins the
    kernels) and its figures cached under ``cache``; -> its output (a failure fails the test)."""
    from click.testing import CliRunner

    from fdplug.cli import main

    monkeypatch.setenv("FDPLUG_OP_TIMING", "1")
    monkeypatch.setenv("FDPLUG_CACHE_DIR", str(cache))
    out = CliRunner().invoke(main, ["explain", "--model", str(model), *args])
    assert out.exit_code == 0, out.output
    return out.output
