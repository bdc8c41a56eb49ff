"""docs/plugins.md's "Writing a plugin", run: a third-party plugin that registers nothing but a device
(examples/fdplug-fakechip, installed through its entry point), with the cpu plugin disabled, gets a
working engine from the core's portable components: same greedy tokens as ``--device cpu``."""

from __future__ import annotations

import pytest

from fdplug.core.frontend.llm import LLM
from fdplug.plugin_api.sampling_params import SamplingParams
from tests.conftest import EXAMPLE_PLUGIN, REPO, install_example_plugin
from tests.serverkit import SMALL, Server

PROMPTS = ["Hello", "The list type", "def f(x):"]


@pytest.fixture
def fakechip(tmp_path, monkeypatch) -> list[str]:
    paths = install_example_plugin(tmp_path / "site")
    for path in reversed(paths):
        monkeypatch.syspath_prepend(path)
    return paths


def test_the_walkthrough_in_the_docs_is_this_example():
    text = (REPO / "docs" / "plugins.md").read_text()
    section = text.split("\n## Writing a plugin\n", 1)[1].split("\n## ", 1)[0]
    assert "(../examples/fdplug-fakechip)" in section and "tests/test_vendor_walkthrough.py" in section
    example = "".join(f.read_text() for f in (EXAMPLE_PLUGIN / "pyproject.toml",
                                              EXAMPLE_PLUGIN / "fdplug_fakechip" / "__init__.py"))
    for line in ('fakechip = "fdplug_fakechip"', 'name="fakechip"', 'paddle_device="cpu"', "priority=-10"):
        assert line in section and line in example, line


def greedy(llm: LLM, prompts: list[str]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_a_device_only_plugin_runs_the_engine_on_the_portable_components(fakechip, monkeypatch):
    expected = greedy(LLM(device="cpu", num_kv_blocks=64, max_model_len=256), PROMPTS)
    monkeypatch.setenv("FDPLUG_DISABLE_PLUGINS", "cpu")
    llm = LLM(device="fakechip", num_kv_blocks=64, max_model_len=256)
    selection = llm.engine.selection
    assert selection.device.name == "fakechip" and selection.runner.name == "default"
    assert {d.plugin for d in selection.decisions if d.chosen and d.role not in ("device", "storage")} == {"core"}
    assert greedy(llm, PROMPTS) == expected
    assert len({tuple(t) for t in expected}) == len(PROMPTS)   # the prompt reaches the model


def test_fakechip_serves_over_http_with_the_cpu_device_tokens(fakechip, tmp_path):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cpu = LLM(device="cpu", max_model_len=512, num_kv_blocks=600)
    expected = [o.outputs[0].text for o in cpu.generate(PROMPTS, params, use_tqdm=False)]
    server = Server(["--device", "fakechip", *SMALL], tmp_path / "fakechip.log", FDPLUG_DISABLE_PLUGINS="cpu",
                    PYTHONPATH=":".join(fakechip)).wait_ready()
    try:
        client = server.openai()
        got = [client.completions.create(model="demo", prompt=p, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
        log = server.log()
    finally:
        server.stop()
    assert "device fakechip" in log
    assert got == expected
