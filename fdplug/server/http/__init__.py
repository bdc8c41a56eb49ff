"""What every HTTP front (``fdplug serve``, ``fdplug router``) shares.

    limits.py            what one client may hold: the per-connection limits (their values)
    connection_guard.py  those limits enforced on each connection (uvicorn's protocol, wrapped)
    drain.py             SIGTERM drains the requests in flight, a second signal aborts

Nothing here imports the API process, the engine or the router.
"""
