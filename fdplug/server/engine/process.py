"""The API process's handle on one engine process: the subprocess and the two sockets it talks over.

Bound here, connected there (`engine.main`): IPC in a private temp dir for an engine on this
machine, TCP with CURVE for one elsewhere (`ray_engines`). ``wait_ready`` is the handshake,
``stop`` the shutdown message, then SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq
import zmq.asyncio

from fdplug.errors import EngineDeadError
from fdplug.server.engine import protocol as P
from fdplug.server.engine.spec import EngineSpec
from fdplug.server.settings import env, env_is_set


class EngineProcess:
    """The engine subprocess and the two sockets, bound here: IPC in a private temp dir, or (for an
    engine on another machine, `ray_engines`) TCP on ``tcp_host`` with CURVE: traffic encrypted,
    and only a peer that was handed this server's public key completes the handshake."""

    def __init__(self, spec_args: dict, log_level: int, tcp_host: str | None = None) -> None:
        slice_us = env("FDPLUG_ENGINE_SLICE_US")   # a malformed value fails here, before anything is created
        self.tmpdir: str | None = None
        self.sync_context = zmq.Context()
        self.async_context = zmq.asyncio.Context()
        self.input_socket = self.sync_context.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.output_socket = self.async_context.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        for sock in (self.input_socket, self.output_socket):
            sock.setsockopt(zmq.LINGER, 0)
        if tcp_host is None:
            self.tmpdir = tempfile.mkdtemp(prefix="fdplug-")
            os.chmod(self.tmpdir, 0o700)  # only this user may connect to the sockets
            input_address, output_address = f"ipc://{self.tmpdir}/input", f"ipc://{self.tmpdir}/output"
            self.input_socket.bind(input_address)
            self.output_socket.bind(output_address)
        else:
            public, secret = zmq.curve_keypair()
            for sock in (self.input_socket, self.output_socket):
                sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
            input_address = f"tcp://{tcp_host}:{self.input_socket.bind_to_random_port(f'tcp://{tcp_host}')}"
            output_address = f"tcp://{tcp_host}:{self.output_socket.bind_to_random_port(f'tcp://{tcp_host}')}"
            spec_args = {**spec_args, "curve_server_key": public.decode()}
        spec = EngineSpec(input_address, output_address, parent_pid=os.getpid(), log_level=log_level,
                          scheduler_slice_us=slice_us, **spec_args)
        self.pid = self._spawn(spec)

    def _spawn(self, spec: EngineSpec) -> int:
        environ = dict(os.environ)
        if not env_is_set("OMP_NUM_THREADS"):   # written by `import paddle` here, not by the user: don't pass it on
            environ.pop("OMP_NUM_THREADS", None)
        package_root = str(Path(__file__).resolve().parents[3])  # the same fdplug as this process
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, environ.get("PYTHONPATH")]))
        self.popen = subprocess.Popen([sys.executable, "-m", "fdplug.server.engine.main", spec.to_json()],
                                      env=environ, stdin=subprocess.DEVNULL)
        return self.popen.pid

    def wake(self) -> None:
        """Expert parallel: a peer engine got a request; this one joins the group's round now, not
        after its idle poll."""
        try:
            self.input_socket.send(P.pack([P.WAKE]), zmq.NOBLOCK)
        except zmq.ZMQError:   # gone: the client's watchdog reports it
            pass

    def poll(self) -> int | None:
        return self.popen.poll()

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()

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
        for action in (None, self.terminate, self.kill):
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
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
        return self.poll()
