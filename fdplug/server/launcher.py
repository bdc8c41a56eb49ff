"""``fdplug serve``: select the selection, start the engine process, run uvicorn, stop cleanly.

Order matters for the user: the port is bound and the selection selected (strict ``--device``
errors, with their fix) before the model loads, so mistakes fail in seconds, not after loading.
The engine process then loads the model and reports ready or a typed startup error.

Stopping: SIGINT/SIGTERM make uvicorn stop accepting; every request in flight ends at once with a
503 error ("shutting down") and the engine is told to exit; the exit status is 0. If the engine
process dies instead, ``/health`` turns 503, requests in flight get a 500, and the exit status is 1.
The engine process is always gone when this returns (shutdown message, SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import uvicorn
import zmq
import zmq.asyncio

from fdplug.errors import ConfigError, EngineDeadError
from fdplug.server import protocol as P
from fdplug.server.engine_process import EngineSpec
from fdplug.server.heap import freeze_startup_heap
from fdplug.server.settings import env, env_is_set

logger = logging.getLogger("fdplug.server")


@dataclass(slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_body_bytes: int = 8 << 20
    stream_interval: int = 1
    trust_request_chat_template: bool = False
    log_level: int = logging.INFO
    data_parallel_size: int = 1


class EngineProcess:
    """The engine subprocess and the two IPC sockets (bound here, in a private temp dir)."""

    def __init__(self, spec_args: dict, log_level: int) -> None:
        slice_us = env("FDPLUG_ENGINE_SLICE_US")   # a malformed value fails here, before anything is created
        self.tmpdir = tempfile.mkdtemp(prefix="fdplug-")
        os.chmod(self.tmpdir, 0o700)  # only this user may connect to the sockets
        self.sync_context = zmq.Context()
        self.async_context = zmq.asyncio.Context()
        self.input_socket = self.sync_context.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.output_socket = self.async_context.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        for sock in (self.input_socket, self.output_socket):
            sock.setsockopt(zmq.LINGER, 0)
        input_address, output_address = f"ipc://{self.tmpdir}/input", f"ipc://{self.tmpdir}/output"
        self.input_socket.bind(input_address)
        self.output_socket.bind(output_address)
        spec = EngineSpec(input_address, output_address, parent_pid=os.getpid(), log_level=log_level,
                          scheduler_slice_us=slice_us, **spec_args)
        environ = dict(os.environ)
        if not env_is_set("OMP_NUM_THREADS"):   # written by `import paddle` here, not by the user: don't pass it on
            environ.pop("OMP_NUM_THREADS", None)
        package_root = str(Path(__file__).resolve().parents[3])  # the same fdplug as this process
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, environ.get("PYTHONPATH")]))
        self.popen = subprocess.Popen([sys.executable, "-m", "fdplug.server.engine_process", spec.to_json()],
                                      env=environ, stdin=subprocess.DEVNULL)
        self.pid = self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()

    async def wait_ready(self, timeout: float, interrupted: asyncio.Event) -> P.EngineInfo:
        """The engine's handshake: its ``EngineInfo``, or its startup error raised here."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not interrupted.is_set():
            if await self.output_socket.poll(100):
                message = P.unpack(await self.output_socket.recv())
                if message[0] == P.READY:
                    return P.EngineInfo.from_dict(message[1])
                if message[0] == P.STARTUP_ERROR:
                    raise P.decode_error(message[1])
            code = self.poll()
            if code is not None:
                raise EngineDeadError(f"the engine process exited with status {code} while starting.",
                                      fix="see the messages above for the cause.")
        if interrupted.is_set():
            raise KeyboardInterrupt
        raise EngineDeadError(f"the engine process did not report ready within {timeout:.0f} s.",
                              fix="set FDPLUG_ENGINE_STARTUP_TIMEOUT higher for a large model, or check the log.")

    async def stop(self, timeout: float) -> int | None:
        """Ask the engine to exit, then SIGTERM, then SIGKILL; close the sockets; remove the temp dir."""
        if self.poll() is None:
            try:
                self.input_socket.send(P.pack([P.SHUTDOWN]), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for action in (None, self.popen.terminate, self.popen.kill):
            if action is not None and self.poll() is None:
                action()
            deadline = time.monotonic() + (timeout if action is None else 2.0)
            while self.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self.poll() is not None:
                break
        self.input_socket.close(0)
        self.output_socket.close(0)
        self.sync_context.term()
        self.async_context.term()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        return self.poll()


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
                          fix="choose another --port (or stop what is using it), or a --host of this machine.") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def serve(settings: ServerSettings, engine_kwargs: dict[str, Any]) -> int:
    """Run the server until a signal (exit status 0) or the engine's death (1)."""
    from fdplug.core.engine.startup import resolve_engine
    from fdplug.core.model.tokenizer import Tokenizer
    from fdplug.server.dp_client import data_parallel_ranks

    kwargs = dict(engine_kwargs)
    model = kwargs.pop("model", None)
    config, model_config, selection = resolve_engine(
        model, kwargs.pop("device", "auto"), kwargs.pop("runner", None), kwargs.pop("attention_backend", None),
        kwargs.pop("moe_backend", None), ops=kwargs.pop("op_kernels", None), **kwargs)
    logger.info("selection:\n%s", selection.explain())
    tokenizer = Tokenizer.from_dir(config.model_dir)
    sock = bind_socket(settings.host, settings.port)
    spec_args = [{"model_dir": config.model_dir, "selection": selection.to_names(), "engine_args": engine_args,
                  "cpus": cpus} for engine_args, cpus in
                 data_parallel_ranks(kwargs, settings.data_parallel_size, selection.device.name == "cpu")]
    name = settings.served_model_name or (model if model else "demo")
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            return runner.run(_serve(settings, spec_args, tokenizer, sock, name))
    finally:
        sock.close()


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
    from fdplug.server.app import build_app
    from fdplug.server.dp_client import DataParallelClient
    from fdplug.server.engine_client import EngineClient
    from fdplug.server.metrics import ServerMetrics

    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # until uvicorn takes over: stop the startup cleanly
        loop.add_signal_handler(sig, interrupted.set)
    engines: list[EngineProcess] = []
    client = None
    try:
        for rank, args in enumerate(spec_args):
            engines.append(EngineProcess(args, logging.getLogger("fdplug").getEffectiveLevel()))
            logger.info("engine process %spid %d%s: loading %s", f"{rank} " if len(spec_args) > 1 else "",
                        engines[-1].pid, f" on cores {args['cpus']}" if args["cpus"] else "", args["model_dir"])
        try:
            infos = await asyncio.gather(*(e.wait_ready(env("FDPLUG_ENGINE_STARTUP_TIMEOUT"), interrupted)
                                           for e in engines))
        except KeyboardInterrupt:
            logger.warning("interrupted while the engine was starting")
            return 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        metrics = ServerMetrics(name)
        clients = [EngineClient(engine, info, tokenizer, metrics, stall_timeout=env("FDPLUG_ENGINE_STALL_TIMEOUT"),
                                rank=rank, data_parallel_size=len(engines))
                   for rank, (engine, info) in enumerate(zip(engines, infos))]
        client = clients[0] if len(clients) == 1 else DataParallelClient(clients)
        info = infos[0]
        api_key = settings.api_key if settings.api_key is not None else env("FDPLUG_API_KEY")
        app = build_app(client, name, api_key, settings.max_body_bytes, settings.stream_interval,
                        settings.trust_request_chat_template)
        shutdown_timeout = env("FDPLUG_SHUTDOWN_TIMEOUT")
        server = _Server(uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                                        timeout_graceful_shutdown=int(max(1, shutdown_timeout)),
                                        timeout_keep_alive=5),
                         on_signal=lambda: loop.call_soon_threadsafe(client.begin_shutdown))
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
        await server.serve(sockets=[sock])
        if not client.healthy and exit_code == 0 and not server.signalled:
            exit_code = 1
        return exit_code
    finally:
        if client is not None:
            if client.healthy:
                client.begin_shutdown()
            await client.close()
        codes = await asyncio.gather(*(engine.stop(env("FDPLUG_SHUTDOWN_TIMEOUT")) for engine in engines))
        logger.info("engine process%s exited (status %s); server stopped", "es" if len(codes) > 1 else "",
                    ", ".join(str(code) for code in codes))


class _Server(uvicorn.Server):
    """uvicorn's Server, with signals that end requests in flight instead of waiting for them.

    uvicorn re-raises a caught signal after shutting down (so the process dies *by* SIGTERM, status
    -15); a service manager reads that as a crash. Here a signal is a normal stop: status 0.
    """

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_signal = on_signal
        self.signalled = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
        if not self.signalled:
            self.signalled = True
            logger.info("%s: stopping", signal.Signals(sig).name)
            self.on_signal()
