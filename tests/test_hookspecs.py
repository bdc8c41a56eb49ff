"""The contract itself: every role of the architecture has a documented hook, and only those."""

from __future__ import annotations

import inspect

import fdplug
from fdplug.core import hookspecs
from fdplug.core.plugins import REGISTRATION_HOOKS
from fdplug.core.specs import SPEC_TYPES

EXPECTED_HOOKS = {
    "fdplug_register_devices", "fdplug_register_model_runners", "fdplug_register_attention_backends",
    "fdplug_register_moe_backends", "fdplug_register_feature_storages", "fdplug_configure",
}


def hook_functions():
    return {name: fn for name, fn in vars(hookspecs).items() if name.startswith("fdplug_") and callable(fn)}


def test_exactly_the_architecture_hooks():
    assert set(hook_functions()) == EXPECTED_HOOKS


def test_every_hook_is_a_spec_with_a_docstring_saying_when_it_is_called():
    for name, fn in hook_functions().items():
        assert hasattr(fn, "fdplug_spec"), f"{name} is not marked @hookspec"
        doc = inspect.getdoc(fn) or ""
        assert len(doc) > 100, f"{name} needs a real docstring"
        assert "Called" in doc, f"{name}'s docstring must say when it is called"


def test_registration_hooks_take_register_and_map_to_a_spec_type():
    for hook, role in REGISTRATION_HOOKS.items():
        assert list(inspect.signature(hook_functions()[hook]).parameters) == ["register"]
        assert role in SPEC_TYPES
    assert set(REGISTRATION_HOOKS.values()) == set(SPEC_TYPES)


def test_api_version_and_reexports():
    major, minor = hookspecs.API_VERSION.split(".")
    assert major.isdigit() and minor.isdigit()
    assert fdplug.hookimpl is hookspecs.hookimpl
    assert fdplug.API_VERSION == hookspecs.API_VERSION
