"""Plugins in, one selection out.

    loader.py     built-ins, the core's own components (plugin "core"), entry points, allow/deny
                  lists, API versions, fault isolation
    registry.py   every validated spec by role and name; a plugin's registrations commit all or nothing
    selection.py  one component per role for the device (explicit > priority > name), with reasons
"""
