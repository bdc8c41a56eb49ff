"""The API process of ``fdplug serve``: OpenAI HTTP in, engine processes behind.

    launcher.py        start/stop the engine process(es) and uvicorn, signals, startup log
    server_settings.py ``ServerSettings``: how ``fdplug serve`` was asked to run
    app.py             the FastAPI app and its routes (behind `fdplug.server.http.guard`)
    jobs.py            an OpenAI request checked, templated and tokenized into a Job
    serving.py         a Job's sequences answered: one JSON body or a stream
    openai_types.py    request models and response shapes
    pd_params.py       ``kv_transfer_params`` checked at the HTTP boundary
    engine_client.py   one engine: submit, abort, route outputs, watchdog
    request_stream.py  one request's way back to its HTTP handler
    dp_client.py       data parallel: N engine clients behind the face of one
    dp_router.py       which data-parallel engine gets a request
    metrics.py         Prometheus metrics
"""
