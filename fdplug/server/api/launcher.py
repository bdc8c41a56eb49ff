"""``fdplug serve``: select the selection, start the engine process(es), run uvicorn, stop cleanly.

Order matters for the user: the port is bound and the selection selected (strict ``--device``
errors, with their fix) before the model loads, so mistakes fail in seconds, not after loading.
The engine process then loads the model and reports ready or a typed startup error.

Stopping (`drain`): SIGINT/SIGTERM turn new requests and ``/health`` into 503s while the requests in
flight finish, for at most ``--shutdown-timeout`` seconds; what is left is then aborted (a 503 error
each) and the engine is told to exit; the exit status is 0. A second signal aborts at once. If the
engine process dies instead, ``/health`` turns 503, requests in flight get a 500, and the exit status is 1.
The engine process is always gone when this returns (shutdown message, SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable
from typing import Any

from fdplug.core.heap import freeze_startup_heap
from fdplug.core.parsers.chat_output import ChatParsers
from fdplug.errors import ConfigError
from fdplug.server.api.server_settings import ServerSettings
from fdplug.server.engine import protocol as P
from fdplug.server.http.drain import Drain, DrainingServer
from fdplug.server.settings import env

logger = logging.getLogger("fdplug.server")


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before loading anything: a taken port fails in a second, with the fix."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}.",
                          fix="choose another --port (or stop what is using it), "
                              "or a --host of this machine.") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def serve(settings: ServerSettings, engine_kwargs: dict[str, Any]) -> int:
    """Run the server until a signal (exit status 0) or the engine's death (1)."""
    from fdplug.core.engine.startup import resolve_engine
    from fdplug.core.model.text.tokenizer import Tokenizer
    from fdplug.server.engine.engine_set import data_parallel_ranks, expert_parallel_ranks

    kwargs = dict(engine_kwargs)
    ep_size = settings.expert_parallel_size
    if ep_size > 1:
        check_expert_parallel(settings)
        settings.data_parallel_size = ep_size
        kwargs["expert_parallel_size"] = ep_size
    model = kwargs.pop("model", None)
    config, model_config, selection = resolve_engine(
        model, kwargs.pop("device", "auto"), kwargs.pop("runner", None), kwargs.pop("attention_backend", None),
        kwargs.pop("moe_backend", None), ops=kwargs.pop("op_kernels", None),
        kv_connector=kwargs.pop("kv_connector", None), **kwargs)
    logger.info("selection:\n%s", selection.explain())
    settings.parsers = chat_parsers(settings)
    expert_parallel = expert_parallel_ranks(model_config, ep_size)
    tokenizer = Tokenizer.from_dir(config.model_dir)
    sock = bind_socket(settings.host, settings.port)
    pin = selection.device.name == "cpu" and settings.data_parallel_backend == "mp"   # Ray places its own
    spec_args = [{"model_dir": config.model_dir, "selection": selection.to_names(), "engine_args": engine_args,
                  "cpus": cpus if pin else None, "expert_parallel": expert_parallel[rank] if expert_parallel else None}
                 for rank, (engine_args, cpus) in enumerate(data_parallel_ranks(kwargs, settings.data_parallel_size,
                                                                                selection.device.name == "cpu"))]
    name = settings.served_model_name or (model if model else "demo")
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            return runner.run(_serve(settings, spec_args, tokenizer, sock, name))
    finally:
        sock.close()


def chat_parsers(settings: ServerSettings) -> ChatParsers:
    """``--reasoning-parser`` and ``--tool-call-parser`` by name, before the model loads."""
    from fdplug.core.plugin_loading.loader import current_plugins
    from fdplug.core.plugin_loading.selection import select_parsers

    if settings.enable_auto_tool_choice and settings.tool_call_parser is None:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser: the model's format for its calls.",
                          fix="add --tool-call-parser NAME (hermes for Qwen2.5/Qwen3/ChatML templates; "
                              "`fdplug plugins` lists the others).")
    return select_parsers(current_plugins(), settings.reasoning_parser, settings.tool_call_parser)


def check_expert_parallel(settings: ServerSettings) -> None:
    """Expert parallel's ranks are the data-parallel engines: the sizes agree (or DP is left out)."""
    if settings.data_parallel_size not in (1, settings.expert_parallel_size):
        raise ConfigError(f"--expert-parallel-size {settings.expert_parallel_size} with --data-parallel-size "
                          f"{settings.data_parallel_size}: the expert-parallel ranks are the data-parallel engines.",
                          fix="leave --data-parallel-size out, or give both the same size.")


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop where it is installed (``FDPLUG_EVENT_LOOP``), else None: asyncio's own.

    Every streamed token is a socket write; uvloop's C transports make the API process's share of
    the machine smaller, which on a CPU device is the engine's gain.
    """
    choice = env("FDPLUG_EVENT_LOOP")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError("FDPLUG_EVENT_LOOP=uvloop, but uvloop is not installed.",
                              fix="pip install uvloop, or unset FDPLUG_EVENT_LOOP.") from None
        return None
    return uvloop.new_event_loop


async def _serve(settings: ServerSettings, spec_args: list[dict], tokenizer: Any, sock: socket.socket,
                 name: str) -> int:
    from fdplug.server.api.app import build_app
    from fdplug.server.api.dp_client import DataParallelClient
    from fdplug.server.api.engine_client import EngineClient
    from fdplug.server.api.metrics import ServerMetrics
    from fdplug.server.engine.engine_set import EngineSet
    from fdplug.server.engine.process import EngineProcess

    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    # a signal during startup stops it cleanly; one before uvicorn serves, or after it is done (stopping the
    # engines), is noted instead of killing the process (uvicorn's own handlers are in place while it serves)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupted.set)
    engine_set = None
    client = None
    try:
        engine_set = EngineSet(spec_args, logging.getLogger("fdplug").getEffectiveLevel(),
                               settings.data_parallel_backend, settings.ray_address)
        engines = engine_set.engines
        for rank, (args, engine) in enumerate(zip(spec_args, engines)):
            logger.info("engine process %spid %d%s: loading %s", f"{rank} " if len(spec_args) > 1 else "",
                        engine.pid, f" on cores {args['cpus']}" if args["cpus"] else "", args["model_dir"])
        try:
            infos = await asyncio.gather(*(e.wait_ready(env("FDPLUG_ENGINE_STARTUP_TIMEOUT"), interrupted)
                                           for e in engines))
        except KeyboardInterrupt:
            logger.warning("interrupted while the engine was starting")
            return 0
        metrics = ServerMetrics(name)

        def engine_client(engine: EngineProcess, info: P.EngineInfo, rank: int) -> EngineClient:
            return EngineClient(engine, info, tokenizer, metrics, stall_timeout=env("FDPLUG_ENGINE_STALL_TIMEOUT"),
                                rank=rank, data_parallel_size=len(engines))

        async def restart(rank: int) -> EngineClient:
            await engines[rank].stop(env("FDPLUG_ENGINE_STOP_TIMEOUT"))       # its resources, free for the new one
            engines[rank] = await asyncio.to_thread(engine_set.make, rank)   # off the event loop: Ray starts an actor
            info = await engines[rank].wait_ready(env("FDPLUG_ENGINE_STARTUP_TIMEOUT"), asyncio.Event())
            return engine_client(engines[rank], info, rank)

        clients = [engine_client(engine, info, rank) for rank, (engine, info) in enumerate(zip(engines, infos))]
        restarts = settings.data_parallel_backend == "ray" and settings.expert_parallel_size == 1  # a group: as one
        client = clients[0] if len(clients) == 1 else DataParallelClient(
            clients, restart if restarts else None, lockstep=settings.expert_parallel_size > 1)
        info = infos[0]
        api_key = settings.api_key if settings.api_key is not None else env("FDPLUG_API_KEY")
        drain = Drain(settings.shutdown_timeout, client.begin_shutdown)
        app = build_app(client, name, settings, api_key, spec_args[0]["engine_args"].get("kv_role"), drain)
        server = DrainingServer(app, drain, loop, settings.limits)
        exit_code = 0

        def engine_dead() -> None:
            nonlocal exit_code
            exit_code = 1
            loop.call_later(0.5, setattr, server, "should_exit", True)  # let the 500s reach their clients

        client.on_engine_dead = engine_dead
        client.start()
        frozen = freeze_startup_heap()
        host, port = sock.getsockname()[:2]
        shown_host = f"[{host}]" if ":" in host else host
        logger.info("model %s (%s, %s) served as %r; max_model_len %d; vocab %d", info.model_dir, info.architecture,
                    info.dtype, name, info.max_model_len, info.vocab_size)
        logger.info("device %s; KV cache %s; max_num_seqs %d, max_num_batched_tokens %d%s", info.selection["device"],
                    info.kv_cache_description, info.max_num_seqs, info.max_num_batched_tokens,
                    f"; each of {len(engines)} data-parallel engines" if len(engines) > 1 else "")
        logger.info("API key %s", "required (Authorization: Bearer ...)" if api_key else
                    "not set: anyone who can reach the port can use it")
        logger.info("API process event loop: %s (FDPLUG_EVENT_LOOP); %d startup objects frozen out of GC passes; "
                    "streaming %s", type(loop).__module__.partition(".")[0], frozen,
                    "a chunk per step" if settings.stream_interval == 1 else
                    f"the first token, then chunks of {settings.stream_interval} tokens (--stream-interval)")
        logger.info("fdplug serving on http://%s:%d (OpenAI API under /v1; /health, /metrics)", shown_host, port)
        if interrupted.is_set():
            logger.info("stopped before serving (a signal)")
            return 0
        await server.serve(sockets=[sock])
        if not client.healthy and exit_code == 0 and not server.signalled:
            exit_code = 1
        return exit_code
    finally:
        if client is not None:
            if client.healthy:
                client.begin_shutdown()
            await client.close()
        if engine_set is not None:
            codes = await engine_set.stop(env("FDPLUG_ENGINE_STOP_TIMEOUT"))
            logger.info("engine process%s exited (status %s); server stopped", "es" if len(codes) > 1 else "",
                        ", ".join(str(code) for code in codes))
