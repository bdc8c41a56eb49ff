"""pytest plugin of the conformance kit: the ``--fdplug-device`` option and the fixtures.

Light on purpose: it is loaded into every pytest run where fdplug is installed, so it imports
neither paddle nor any plugin until a kit test asks for a fixture.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fdplug", "fdplug conformance kit")
    group.addoption("--fdplug-device", default="cpu",
                    help="device whose backends the conformance kit checks (default: cpu)")
    group.addoption("--fdplug-atol", type=float, default=1e-4,
                    help="absolute tolerance against the CPU reference (default 1e-4, fp32)")


def _components_for(config: pytest.Config, role: str) -> list[str]:
    from fdplug.core.plugin_loading.loader import load_plugins

    device = config.getoption("--fdplug-device")
    registry = load_plugins().registry
    return sorted(e.spec.name for e in registry.entries(role) if e.spec.runs_on(device))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize kit tests over every attention/MoE backend and KV connector that runs on the device under test."""
    for fixture, role in (("attention_backend_name", "attention"), ("moe_backend_name", "moe"),
                          ("kv_connector_name", "kv_connector")):
        if fixture in metafunc.fixturenames:
            names = _components_for(metafunc.config, role)
            metafunc.parametrize(fixture, names or [None], ids=[f"{role}={n}" for n in names] or [f"no-{role}"])


@pytest.fixture(scope="session")
def fdplug_device(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--fdplug-device")


@pytest.fixture(scope="session")
def fdplug_atol(request: pytest.FixtureRequest) -> float:
    return request.config.getoption("--fdplug-atol")


@pytest.fixture(scope="session")
def fdplug_plugin_set():
    from fdplug.core.plugin_loading.loader import load_plugins

    return load_plugins()


@pytest.fixture(scope="session")
def fdplug_selection(fdplug_device: str, fdplug_plugin_set):
    """The selection selected for the device under test; the device must be available here."""
    from fdplug.core.plugin_loading.selection import select_components

    selection = select_components(fdplug_device, plugins=fdplug_plugin_set)
    selection.device.setup and selection.device.setup()
    return selection


@pytest.fixture(scope="session")
def fdplug_place(fdplug_selection) -> str:
    return fdplug_selection.device.paddle_place_name(0)
