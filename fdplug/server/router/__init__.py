"""``fdplug router``: one OpenAI-compatible front over prefill and decode instances.

    pd_router.py   the two pools and the request flow (prefill, then decode), the router's app
    metrics.py     the router's own ``/metrics``
"""
