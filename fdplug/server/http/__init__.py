"""What every HTTP front (``fdplug serve``, ``fdplug router``) shares.

    limits.py            what one client may hold: the per-connection limits (their values)
    connection_guard.py  those limits enforced on each connection (uvicorn's protocol, wrapped)
    drain.py             SIGTERM drains the requests in flight, a second signal aborts
    guard.py             the ASGI guard in front of an app: the drain's door, the API key, the body size
    error_responses.py   OpenAI error objects as answers: a route's errors, unknown paths, wrong methods

Nothing here imports the API process, the engine or the router.
"""
