"""Conformance kit: the checks a third-party backend runs against itself.

    pytest --pyargs fdplug.testing --fdplug-device NAME

It checks the device's registration and probe contract, the numerics of every attention and MoE
backend that runs on the device against the CPU reference on seeded random inputs, and a storage
round trip. The pytest plugin (`fdplug.testing.plugin`) is registered through the ``pytest11``
entry point when fdplug is installed, so the option is always there.
"""
