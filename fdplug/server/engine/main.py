"""The engine process: EngineCore's step loop (`loop`) behind two ZMQ sockets.

Why a process of its own: the step loop is compute-bound Python; next to the HTTP server in one
process, the GIL would make tokenizing, SSE and step interleave badly.

The API process starts it with ``python -m fdplug.server.engine.main SPEC_JSON`` and binds
both sockets first; this side connects. The selection is rebuilt from ``Selection.to_names()`` with
``resolve_engine`` (the same code the API process ran), so both processes agree on the selection.
It exits when told to ("shutdown"), when its parent dies (PR_SET_PDEATHSIG, and ``getppid()``
polled every loop), or with status 1 after reporting an error it cannot serve past.

Expert parallel (``EngineSpec.expert_parallel``): the process first joins its paddle.distributed
group (before the model loads: the model's MoE layers are the group's), then the loop keeps the
group's lockstep.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import zmq

from fdplug.core.heap import freeze_startup_heap
from fdplug.errors import FdplugError
from fdplug.server.engine import protocol as P
from fdplug.server.engine.lockstep_loop import LockstepEngineLoop
from fdplug.server.engine.loop import EngineLoop
from fdplug.server.engine.os_timeslice import shorten_scheduler_slice
from fdplug.server.engine.spec import EngineSpec
from fdplug.server.settings import env

logger = logging.getLogger("fdplug.engine_process")


def _die_with_parent() -> None:
    """Linux: get SIGTERM when the parent dies, even by SIGKILL (getppid() polling is the fallback)."""
    if sys.platform != "linux":
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def run_engine(spec: EngineSpec) -> int:
    """Build the engine, report ready (or the typed error), run the loop. Returns the exit status."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API process decides
    _die_with_parent()
    if os.getppid() != spec.parent_pid:
        return 1
    slice_ns, why = shorten_scheduler_slice(spec.scheduler_slice_us)   # before any thread starts: they inherit it
    logger.info("engine process scheduler slice: %s, %s", "unknown" if slice_ns is None else f"{slice_ns / 1e6:g} ms",
                why)
    context = zmq.Context()
    input_socket = context.socket(zmq.PULL)
    output_socket = context.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.SNDHWM, 0)   # never block a step on a slow reader; the parent's death ends us
    for sock in (input_socket, output_socket):
        sock.setsockopt(zmq.LINGER, 1000)
        if spec.curve_server_key:   # encrypted, and the API accepts only a peer that knows its key
            sock.curve_serverkey = spec.curve_server_key.encode()
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    input_socket.connect(spec.input_address)
    output_socket.connect(spec.output_address)
    try:
        try:
            group = _join_group(spec)
            core, info = _build(spec)
            if group is not None:   # every rank loaded: from here on the ranks wait on each other in collectives
                group.barrier(env("FDPLUG_ENGINE_STARTUP_TIMEOUT"))
        except Exception as exc:  # typed errors carry their fix; anything else is reported as a bug
            if not isinstance(exc, FdplugError):
                logger.exception("the engine failed to start")
            output_socket.send(P.pack([P.STARTUP_ERROR, P.encode_error(exc)]))
            return 1
        output_socket.send(P.pack([P.READY, info.to_dict()]))
        loop = (EngineLoop(core, input_socket, output_socket, spec.parent_pid) if group is None else
                LockstepEngineLoop(core, input_socket, output_socket, spec.parent_pid, group,
                                   env("FD_EP_BATCHED_TOKEN_TIMEOUT")))
        freeze_startup_heap()
        # after paddle's import (which installs its own SIGTERM handler): SIGTERM, also what the parent's
        # death sends, ends the loop after its current step, so the cleanup below runs. While the API
        # process lives, SIGTERM is its to handle (a whole process group or cgroup gets it: systemd, kill
        # -TERM -PGID): it drains its requests, then tells this engine to stop (or SIGKILLs a stuck one)
        signal.signal(signal.SIGTERM, lambda *_: None if os.getppid() == spec.parent_pid
                      else setattr(loop, "running", False))
        try:
            loop.run()
        except Exception as exc:
            logger.exception("the engine loop crashed")
            output_socket.send(P.pack([P.FATAL, P.encode_error(exc)]))
            return 1
        finally:
            if group is not None:
                logger.info("%s", group.summary())
        return 0
    finally:
        input_socket.close()
        output_socket.close()
        context.term()
        if os.getppid() != spec.parent_pid:  # the API process died without removing its socket directory
            _remove_socket_dir(spec.input_address)


def _join_group(spec: EngineSpec) -> Any:
    """Expert parallel: join the group (paddle.distributed) before the model loads; None alone."""
    if not spec.expert_parallel:
        return None
    from fdplug.core.parallel.lockstep import init_group

    ep = spec.expert_parallel
    return init_group(ep["rank"], ep["size"], ep["endpoints"], spec.selection.get("device", "cpu"),
                      spec.engine_args.get("device_index", 0))


def _remove_socket_dir(address: str) -> None:
    directory = Path(address.removeprefix("ipc://")).parent
    if directory.name.startswith("fdplug-"):
        shutil.rmtree(directory, ignore_errors=True)


def _build(spec: EngineSpec) -> tuple[Any, P.EngineInfo]:
    from fdplug.core.engine.engine_core import EngineCore
    from fdplug.core.engine.startup import resolve_engine
    from fdplug.core.model.text.tokenizer import Tokenizer

    config, model_config, selection = resolve_engine(spec.model_dir, **spec.selection, **spec.engine_args)
    core = EngineCore(config, selection)
    plan = core.kv_plan
    eos = model_config.eos_token_ids or Tokenizer.from_dir(config.model_dir).eos_token_ids
    info = P.EngineInfo(
        pid=os.getpid(), model_dir=config.model_dir, architecture=model_config.architecture, dtype=config.dtype,
        vocab_size=model_config.vocab_size, eos_token_ids=list(eos), max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        max_waiting_requests=config.max_waiting_requests,
        block_size=plan.block_size, num_kv_blocks=plan.num_blocks - 1, kv_cache_tokens=plan.num_tokens,
        kv_cache_description=plan.describe(), selection=core.selection.to_names())
    return core, info


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = EngineSpec.from_json(argv[0])
    if spec.cpus:   # before paddle or any thread starts: every thread inherits it, the cpu device counts it
        os.sched_setaffinity(0, spec.cpus)
    logging.basicConfig(level=spec.log_level, format="%(levelname)s %(name)s[engine]: %(message)s")
    code = run_engine(spec)
    if spec.expert_parallel:     # a rank leaves with its group, then exits at once (group_exit)
        from fdplug.core.parallel.group_exit import exit_process, leave_group
        from fdplug.core.parallel.lockstep import current_group

        if (group := current_group()) is not None:
            leave_group(group.rank, group.size)
            exit_process(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
