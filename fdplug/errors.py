"""Typed errors that a user can cause.

Every error here says what was wrong and how to fix it, and never carries a secret. The server maps
them to OpenAI error objects through ``http_status``; anything not derived from ``FdplugError`` is a
bug and becomes a 500.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable

_SHOW = reprlib.Repr()
_SHOW.maxstring, _SHOW.maxother, _SHOW.maxlist, _SHOW.maxdict, _SHOW.maxlevel = 60, 60, 6, 4, 2


def show_value(value: object) -> str:
    """A client's value, short enough for an error message, whatever it is: a 10,000-digit integer
    (whose ``repr`` Python refuses) or a list of a million items (whose ``repr`` takes a while)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return f"an integer of {len(format(value, 'x')) * 4 // 3.32:.0f}-odd digits"
    try:
        return _SHOW.repr(value)
    except ValueError:       # an int nested somewhere with too many digits to print
        return f"a {type(value).__name__}"


class FdplugError(Exception):
    """Base of every user-facing fdplug error.

    ``fix`` is the one-line remedy; ``str(err)`` includes it so a log line or a CLI message is
    complete on its own. ``param`` names the request field at fault (OpenAI's ``error.param``).
    """

    http_status = 400
    error_type = "invalid_request_error"
    param: str | None = None

    def __init__(self, message: str, *, fix: str | None = None, param: str | None = None) -> None:
        self.message = message
        self.fix = fix
        if param is not None:
            self.param = param
        super().__init__(f"{message} Fix: {fix}" if fix else message)


class ConfigError(FdplugError, ValueError):
    """A setting, argument or environment variable has a value fdplug cannot use."""


class PaddleNotInstalledError(FdplugError, ImportError):
    """PaddlePaddle is needed for this and is not importable."""

    http_status = 500
    error_type = "server_error"


# ---------------------------------------------------------------------------------------------------
# plugins and selection
# ---------------------------------------------------------------------------------------------------


class PluginError(FdplugError):
    """A plugin could not be loaded or registered (fatal only in strict mode)."""

    http_status = 500
    error_type = "server_error"


class PluginVersionError(PluginError):
    """A plugin was written for another major version of the hook API."""


class RegistrationError(PluginError, TypeError):
    """A plugin registered something malformed or a name that is already taken."""


class SelectionError(FdplugError):
    """No implementation could be chosen for a role (device, runner, attention, MoE, storage)."""

    http_status = 500
    error_type = "server_error"

    def __init__(self, message: str, *, fix: str | None = None, decisions: tuple = ()) -> None:
        super().__init__(message, fix=fix)
        self.decisions = decisions


class DeviceUnavailableError(SelectionError):
    """The device asked for explicitly is known but its probe says it cannot be used here."""


class UnknownComponentError(SelectionError):
    """A device or component was asked for by a name no loaded plugin registered."""


# ---------------------------------------------------------------------------------------------------
# feature storage
# ---------------------------------------------------------------------------------------------------


class StorageError(FdplugError):
    """Fetching a multimodal feature failed. ``url`` never contains credentials."""

    http_status = 502
    error_type = "storage_error"

    def __init__(self, message: str, *, url: str = "", fix: str | None = None) -> None:
        super().__init__(message, fix=fix)
        self.url = url


class FeatureNotFoundError(StorageError):
    """The object does not exist (or access is denied): retrying cannot help."""

    http_status = 400


class FeatureAccessDeniedError(StorageError):
    """The URL is outside what the operator allowed (path root, host list) or credentials were refused."""

    http_status = 400


class StorageTimeoutError(StorageError):
    """A fetch did not finish within its timeout."""

    http_status = 504


class FeatureFormatError(StorageError):
    """The bytes are not a feature fdplug accepts (format, dtype or shape)."""

    http_status = 400


# ---------------------------------------------------------------------------------------------------
# model loading
# ---------------------------------------------------------------------------------------------------


class ModelLoadError(FdplugError):
    """A model directory cannot be loaded: a file is missing or a config value is unusable."""

    http_status = 500
    error_type = "server_error"


class UnsupportedModelError(ModelLoadError):
    """The model needs something fdplug does not implement (architecture, RoPE type, activation, ...)."""


class WeightMismatchError(ModelLoadError):
    """A checkpoint tensor is missing, unexpected, or has the wrong shape; ``tensor`` names it."""

    def __init__(self, message: str, *, tensor: str, fix: str | None = None) -> None:
        super().__init__(message, fix=fix)
        self.tensor = tensor


# ---------------------------------------------------------------------------------------------------
# requests and scheduling
# ---------------------------------------------------------------------------------------------------


class InvalidRequestError(FdplugError, ValueError):
    """A request (its prompt or its sampling parameters) cannot be served as given."""

    http_status = 400


class QueueFullError(FdplugError):
    """The engine's waiting queue is at its limit: the request was refused, not queued."""

    http_status = 503
    error_type = "server_error"


# ---------------------------------------------------------------------------------------------------
# the API server
# ---------------------------------------------------------------------------------------------------


class AuthenticationError(FdplugError):
    """The request has no API key or the wrong one. The message never echoes the key it got."""

    http_status = 401
    error_type = "invalid_request_error"


class ModelNotFoundError(FdplugError):
    """The request names a model this server does not serve."""

    http_status = 404
    error_type = "invalid_request_error"


class RequestTooLargeError(FdplugError):
    """The request body is over the server's limit (``--max-body-bytes``)."""

    http_status = 413
    error_type = "invalid_request_error"


class EngineDeadError(FdplugError):
    """The engine process exited: requests in flight cannot finish and the server stops."""

    http_status = 500
    error_type = "server_error"


class EngineUnavailableError(FdplugError):
    """The data-parallel engine a request named (``X-Data-Parallel-Rank``) is not running now; the
    others may be: a 503, retry without the header or later (a restarted engine serves again)."""

    http_status = 503
    error_type = "server_error"


class EngineRequestError(FdplugError):
    """The engine failed this request (a step it was in raised); other requests are unaffected."""

    http_status = 500
    error_type = "server_error"


class ParallelGroupError(FdplugError):
    """A collective of the expert-parallel group failed (a peer rank is gone): the group's engines
    cannot step without it, so this engine stops, failing its requests."""

    http_status = 500
    error_type = "server_error"


class KVTransferError(FdplugError):
    """PD decode: this request's prompt KV could not be pulled from its prefill instance."""

    http_status = 502
    error_type = "server_error"


class KVTransferTimeoutError(KVTransferError):
    """PD decode: this request's prompt KV did not land within FDPLUG_KV_TRANSFER_TIMEOUT."""

    http_status = 504


class ServerShuttingDownError(FdplugError):
    """The server is stopping (SIGINT/SIGTERM): it takes no new request while it drains the ones in
    flight, and aborts those still running when ``--shutdown-timeout`` ends."""

    http_status = 503
    error_type = "server_error"


# ---------------------------------------------------------------------------------------------------
# errors as data (they cross the engine-process socket and sit in outputs)
# ---------------------------------------------------------------------------------------------------


def error_to_dict(exc: BaseException) -> dict:
    """A typed error as plain data: its class name, message and fix (no traceback, no secrets)."""
    if isinstance(exc, FdplugError):
        return {"type": type(exc).__name__, "message": exc.message, "fix": exc.fix, "param": exc.param}
    return {"type": type(exc).__name__, "message": f"{type(exc).__name__}: {exc}", "fix": None, "param": None}


def error_from_dict(item: dict) -> FdplugError:
    """The same error class when this module has it, else an ``EngineRequestError`` (a bug, 500)."""
    cls = globals().get(item.get("type", ""))
    if not (isinstance(cls, type) and issubclass(cls, FdplugError)):
        cls = EngineRequestError
    err = cls.__new__(cls)
    param = item.get("param")
    FdplugError.__init__(err, item.get("message") or "unknown error", fix=item.get("fix"),
                         param=param if isinstance(param, str) else None)
    return err


class RequestStepError(Exception):
    """A runner's step failed because of ``request_ids`` (the runner knows whose fault it is);
    ``error`` is what to tell their clients (a typed error, or None for a 500 quoting ``message``).
    Not an `FdplugError`: it travels from a runner to the engine, never to a user."""

    def __init__(self, request_ids: Iterable[str], message: str, error: FdplugError | None = None) -> None:
        super().__init__(message)
        self.request_ids = list(request_ids)
        self.error = error
