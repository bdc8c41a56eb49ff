"""``fdplug serve``: an OpenAI-compatible API process in front of an engine process.

    launcher.py        start/stop both processes, signals, startup log
    engine_process.py  the engine side: EngineCore's step loop behind ZMQ
    protocol.py        the msgpack messages between the two
    engine_client.py   the API side: submit, abort, route outputs, watchdog
    request_stream.py  one request's way back to its HTTP handler
    app.py             FastAPI routes, error objects, API key and body-size guard
    jobs.py            an OpenAI request checked, templated and tokenized into a Job
    serving.py         a Job's sequences answered: one JSON body or a stream
    openai_types.py    request models and response shapes
    metrics.py         Prometheus metrics
    os_timeslice.py    the engine process's short Linux scheduler slice (sched_setattr)
    settings.py        the server's environment variables
"""

from fdplug.server import settings as _settings  # noqa: F401,E402  (declares the server's environment variables)
