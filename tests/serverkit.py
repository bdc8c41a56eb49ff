"""Running a real ``fdplug serve`` for the server tests: start, wait, inspect, stop. Every wait is bounded."""

from __future__ import annotations

import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.conftest import subprocess_env, xdist_worker

FDPLUG = str(Path(sys.executable).parent / "fdplug")
SMALL = ["--max-model-len", "512", "--num-kv-blocks", "600"]   # 9.4 MiB of KV, enough for 32 x 256 tokens


_HANDED_OUT: set[int] = set()
_STARTED: list[subprocess.Popen] = []   # every fdplug process a test started (spawn): what stop_leftovers sweeps


def spawn(args: list[str], log, **env: str) -> subprocess.Popen:
    """``fdplug ARGS`` in a subprocess logging to ``log`` (an open binary file), remembered so that
    stop_leftovers ends it if the test that started it does not (a fixture failing halfway)."""
    proc = subprocess.Popen([FDPLUG, *args], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=subprocess_env(**env))
    _STARTED.append(proc)
    return proc


def stop_leftovers(timeout: float = 10.0) -> list[str]:
    """End every spawned process still running: SIGTERM, then SIGKILL after ``timeout``; the command
    lines of those it ended. (A PD test whose router failed to start once left its two servers and
    the router running after the run, and a server left running takes the cores from every test after it.)"""
    left = [proc for proc in _STARTED if proc.poll() is None]
    _STARTED.clear()
    for proc in left:
        proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in left:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return [" ".join(map(str, proc.args)) for proc in left]


def _own_ports(port: int) -> bool:
    """Whether ``port`` is this pytest-xdist worker's to hand out: the ports in runs of 8, dealt to
    the workers in turn (every port outside xdist). Two workers asking at once could otherwise both
    get a port the kernel just gave back, before either's server binds it; a run of 8 keeps a port
    and its next (two_free_ports) one worker's."""
    worker, workers = xdist_worker()
    return port // 8 % workers == worker


def free_port() -> int:
    """A loopback port nothing listens on now, and never one handed out before in this process: two
    asked for one after another can come back the same before the first one's server binds it (a
    router was once given its prefill server's port); nor one another xdist worker may hand out."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT and _own_ports(port):
            _HANDED_OUT.add(port)
            return port


def status(url: str) -> int | None:
    """The HTTP status of a GET of ``url``, or None when nothing answers there."""
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


@dataclass
class Router:
    """``fdplug router`` started by start_router."""

    proc: subprocess.Popen
    url: str
    port: int
    log: object

    def wait_ready(self, timeout: float = 60.0) -> Router:
        """Once its /health answers 200."""
        wait_until(lambda: status(self.url + "/health") == 200, timeout, 0.1, what="the router answering /health")
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        return stop_process(self.proc, self.log, sig, timeout, "fdplug router")


def start_router(prefill_url: str, decode_url: str, log_path: Path, *extra: str, wait: bool = True) -> Router:
    """``fdplug router`` over one prefill and one decode instance on a free port; with ``wait``, once
    its /health answers 200."""
    port = free_port()
    log = open(log_path, "wb")  # noqa: SIM115 -- Router.stop closes it
    proc = spawn(["router", "--prefill", prefill_url, "--decode", decode_url, "--port", str(port), *extra], log)
    router = Router(proc, f"http://127.0.0.1:{port}", port, log)
    return router.wait_ready() if wait else router


def stop_process(proc: subprocess.Popen, log, sig: int, timeout: float, what: str, log_text=lambda: "") -> int:
    """Signal ``proc`` (if still running) and return its exit code; past ``timeout`` it is killed and
    the test fails with ``log_text()``. Closes ``log`` either way."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired as err:
        proc.kill()
        proc.wait(5)
        raise AssertionError(f"{what} did not exit within {timeout} s of signal {sig}:\n{log_text()}") from err
    finally:
        log.close()


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (no psutil: /proc and signal 0)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached within {timeout} s")


class Server:
    """``fdplug serve`` in a subprocess on a free loopback port; its log goes to a file."""

    def __init__(self, args: list[str], log_path: Path, api_key: str | None = None, **env: str) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = ["serve", "--port", str(self.port), *args] + (["--api-key", api_key] if api_key else [])
        self._log = open(log_path, "wb")  # noqa: SIM115 -- stop closes it
        self.proc = spawn(cmd, self._log, **env)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 90.0) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fdplug serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop(signal.SIGKILL)
        raise TimeoutError(f"fdplug serve not ready within {timeout} s:\n{self.log()}")

    def engine_pid(self) -> int:
        children = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            children += (task / "children").read_text().split()
        assert len(children) == 1, f"expected one engine process, found {children}"
        return int(children[0])

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=5.0).text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name.split("{")[0] if "_bucket" not in name else name] = float(value)
        return values

    def finished(self, reason: str) -> float:
        """Requests (and ``n`` children) this server ended with ``reason``, over every label set."""
        text = httpx.get(self.url + "/metrics", timeout=5.0).text
        return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                   if line.startswith("fdplug:request_success_total{") and f'finished_reason="{reason}"' in line)

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0,
                             timeout=kwargs.pop("timeout", 60.0), **kwargs)

    def async_openai(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0,
                                  timeout=kwargs.pop("timeout", 60.0), **kwargs)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        return stop_process(self.proc, self._log, sig, timeout, "fdplug serve", self.log)


def kernel_honours_custom_slices() -> bool:
    """Linux 6.12+ lets a normal task set its EEVDF slice; older kernels keep their own."""
    release = tuple(int(x) for x in re.findall(r"\d+", platform.release())[:2])
    return sys.platform == "linux" and release >= (6, 12)
