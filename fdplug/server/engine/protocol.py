"""The messages between the API process and the engine process, and their msgpack codec.

Why msgpack and not pickle: unpickling runs code, so a pickle socket is a remote-code-execution
hole for anything that can reach it; msgpack carries only data. Every message is a list whose
first element is its tag; everything else is plain lists, dicts, strings and numbers, so both
sides can be read (and fuzzed) without importing the other.

API -> engine (one PUSH/PULL socket, in order):
  ["add", [request, ...]]              requests to queue (``encode_request``)
  ["abort", [request_id, ...], status] finish these (status: a ``RequestStatus`` value)
  ["shutdown"]                         abort everything and exit 0

engine -> API (one PUSH/PULL socket, in order):
  ["ready", info]                      the engine loaded the model (``EngineInfo`` as a dict)
  ["startup_error", error]             it could not (``encode_error``); the process exits 1
  ["admitted", [request_id, ...], [[request_id, error], ...]]  what the last "add"s became
  ["outputs", [output, ...], stats|None]  every ``EngineCoreOutput`` of one step, in one message
  ["stats", stats]                     a ``SchedulerStats`` snapshot (also a heartbeat when idle)
  ["fatal", error]                     the loop itself crashed (a bug); the process exits 1
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgpack

from fdplug import errors
from fdplug.core.multimodal.inputs import MMFeatureInput
from fdplug.core.request import Request
from fdplug.core.scheduler.output import EngineCoreOutput, SchedulerStats
from fdplug.plugin_api.sampling_params import SamplingParams
from fdplug.plugin_api.scheduled_work import MMPlaceholder

ADD, ABORT, SHUTDOWN, WAKE = "add", "abort", "shutdown", "wake"   # wake: expert parallel, a peer got work
READY, STARTUP_ERROR, ADMITTED, OUTPUTS, STATS, FATAL = (
    "ready", "startup_error", "admitted", "outputs", "stats", "fatal")

_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def _default(obj: Any) -> Any:
    """numpy scalars and arrays (a sampler may return them) become plain numbers and lists."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, (tuple, set, frozenset)):
        return list(obj)
    raise TypeError(f"cannot send a {type(obj).__name__} to the other process")


_packer_options = {"default": _default, "use_bin_type": True}


def pack(message: list) -> bytes:
    return msgpack.packb(message, **_packer_options)


def unpack(data: bytes) -> list:
    message = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if not isinstance(message, list) or not message or not isinstance(message[0], str):
        raise ValueError(f"malformed message: {message!r:.200}")
    return message


# -- requests -----------------------------------------------------------------------------------------


def encode_request(request: Request) -> list:
    params = request.sampling_params
    return [request.request_id, request.prompt_token_ids, {name: getattr(params, name) for name in _PARAM_FIELDS},
            list(request.eos_token_ids), request.cache_salt, request.arrival_time,
            [[m.offset, m.length, m.mm_hash, m.span_length, list(m.grid_thw), m.modality]
             for m in request.mm_positions],
            [[i.modality, list(i.urls), list(i.grid_thw), i.num_tokens, i.mm_hash, i.data] for i in request.mm_inputs],
            request.kv_transfer_params]


def decode_request(item: list) -> Request:
    request_id, prompt_ids, params, eos, cache_salt, arrival_time, mm, inputs, kv_transfer_params = item
    return Request(request_id, prompt_ids, SamplingParams(**params), tuple(eos), arrival_time=arrival_time,
                   cache_salt=cache_salt, mm_positions=[MMPlaceholder(o, n, h, s, tuple(g), m)
                                                 for o, n, h, s, g, m in mm],
                   mm_inputs=[MMFeatureInput(m, tuple(u), tuple(g), n, h, d) for m, u, g, n, h, d in inputs],
                   kv_transfer_params=kv_transfer_params)


# -- outputs ------------------------------------------------------------------------------------------


def encode_output(out: EngineCoreOutput) -> list:
    return [out.request_id, out.new_token_ids, out.finished, out.finish_reason, out.stop_reason,
            out.num_cached_tokens, out.new_logprobs, out.error, out.kv_transfer_params]


def decode_output(item: list) -> EngineCoreOutput:
    return EngineCoreOutput(*item)


def encode_stats(stats: SchedulerStats) -> dict:
    return dataclasses.asdict(stats)


def decode_stats(item: dict) -> SchedulerStats:
    return SchedulerStats(**item)


# -- errors -------------------------------------------------------------------------------------------


encode_error = errors.error_to_dict


def decode_error(item: dict) -> errors.FdplugError:
    """The same error class when ``fdplug.errors`` has it, else an ``EngineDeadError`` (a bug)."""
    err = errors.error_from_dict(item)
    if type(err) is errors.EngineRequestError and item.get("type") != "EngineRequestError":
        err = errors.EngineDeadError(err.message, fix=err.fix)
    return err


# -- handshake ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class EngineInfo:
    """What the engine reports when it is ready: the API process sizes its checks from these."""

    pid: int
    model_dir: str
    architecture: str
    dtype: str
    vocab_size: int
    eos_token_ids: list[int]
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting_requests: int
    block_size: int
    num_kv_blocks: int  # usable blocks (the null block excluded)
    kv_cache_tokens: int
    kv_cache_description: str
    selection: dict

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, item: dict) -> EngineInfo:
        return cls(**item)
