"""The engine process and the API process's handles on it.

    main.py            the engine process (``python -m fdplug.server.engine.main SPEC``): EngineCore behind ZMQ
    loop.py            its step loop: drain messages, step, send outputs
    protocol.py        the msgpack messages between the API process and an engine process
    spec.py            ``EngineSpec``: what an engine process is started with (JSON on its command line)
    process.py         ``EngineProcess``: the API side's handle on one engine subprocess and its sockets
    engine_set.py      ``EngineSet``: a server's engine processes; each rank's arguments, cores, EP place
    ray_engines.py     engine processes placed by Ray (``--data-parallel-backend ray``)
    os_timeslice.py    the engine process's short Linux scheduler slice (sched_setattr)

Nothing here imports the API process (`fdplug.server.api`).
"""
