"""``fdplug serve`` and ``fdplug router``: the HTTP servers, each in a room of its own.

    api/        the API process: the FastAPI app, OpenAI requests to jobs to answers, the engine
                clients (one, or data parallel), metrics, and the launcher that starts it all
    engine/     the engine process (EngineCore's step loop behind ZMQ), its msgpack protocol, and
                the API process's handles on engine processes (local or placed by Ray)
    router/     ``fdplug router``: the prefill/decode front over ``fdplug serve --role`` instances
    http/       what every HTTP front shares: per-connection limits, draining on SIGTERM
    settings.py the server's environment variables (imported here so that they are declared)

Who imports whom: ``api`` and ``router`` use ``engine`` and ``http``; ``router`` uses ``api``'s
request checks; ``engine`` and ``http`` use neither; every room may read ``settings``.
"""

from fdplug.server import settings as _settings  # noqa: F401,E402  (declares the server's environment variables)
