"""The server tests' harness itself: ports never handed out twice, and no process outliving its module."""

from __future__ import annotations

import subprocess
import sys

from tests import serverkit


def test_free_port_never_hands_out_the_same_port_twice():
    ports = [serverkit.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


def test_stop_leftovers_ends_what_is_still_running_and_only_that(monkeypatch):
    monkeypatch.setattr(serverkit, "_STARTED", [])
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait(30)
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n"
                                 "time.sleep(600)"], stdout=subprocess.PIPE)
    assert stubborn.stdout.readline() == b"ready\n"     # SIGTERM is ignored from here on
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    serverkit._STARTED.extend([done, stubborn, polite])
    left = serverkit.stop_leftovers(timeout=2.0)
    assert len(left) == 2 and all("sleep(600)" in line for line in left)
    assert polite.returncode == -15 and stubborn.returncode == -9      # SIGTERM; SIGKILL after the timeout
    stubborn.stdout.close()
    assert serverkit._STARTED == [] and serverkit.stop_leftovers() == []
