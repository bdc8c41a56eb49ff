"""What went wrong with a BOS request, in words that are safe to show.

The SDK's exceptions carry full tracebacks and, at debug level, its loggers print request headers
(the ``Authorization`` value starts with the access key) and the signing key. So a failure is
reduced here to a kind and a short detail built only from the status, the BOS error code and the
connection error's type, and the SDK's loggers get a filter that redacts credentials.
"""

from __future__ import annotations

import http.client
import logging
import re
import socket
import threading
from dataclasses import dataclass

from fdplug.errors import (
    FeatureAccessDeniedError,
    FeatureNotFoundError,
    StorageError,
    StorageTimeoutError,
)

THROTTLE_CODES = frozenset({"SlowDown", "RequestRateLimitExceeded", "TooManyRequests"})
RETRYABLE_KINDS = frozenset({"throttled", "server", "connection", "timeout"})
_PATTERNS = (re.compile(r"bce-auth-v1/[^\s'\"\]\)]+"), re.compile(r"sign_key=\[[^\]]*\]"),
             re.compile(r"(x-bce-security-token['\"]?\s*[:=]\s*b?['\"]?)[^'\"\s,}]+", re.IGNORECASE))
_HIDDEN = "<hidden>"


@dataclass(frozen=True, slots=True)
class Failure:
    """One failed attempt. ``detail`` never contains a credential."""

    kind: str  # not_found | denied | throttled | server | connection | timeout | client
    detail: str

    @property
    def retryable(self) -> bool:
        return self.kind in RETRYABLE_KINDS


def redact(text: str, secrets: tuple[str, ...] | frozenset[str]) -> str:
    """``text`` with every known secret and every signature-like token replaced by ``<hidden>``."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, _HIDDEN)
    text = _PATTERNS[0].sub("bce-auth-v1/" + _HIDDEN, text)
    text = _PATTERNS[1].sub("sign_key=[" + _HIDDEN + "]", text)
    return _PATTERNS[2].sub(r"\1" + _HIDDEN, text)


def classify(exc: BaseException, secrets: tuple[str, ...]) -> Failure:
    """Reduce an SDK or socket exception to a `Failure` (called only after the SDK was imported)."""
    from baidubce.exception import BceClientError, BceServerError

    cause = getattr(exc, "last_error", None) or exc
    status = getattr(exc, "status_code", None) or getattr(cause, "status_code", None)
    code = getattr(exc, "code", None) or getattr(cause, "code", None)
    if status is not None or isinstance(cause, BceServerError):
        return _by_status(status, code)
    if isinstance(cause, (socket.timeout, TimeoutError)):
        return Failure("timeout", f"no response within the timeout ({type(cause).__name__})")
    if isinstance(cause, (OSError, http.client.HTTPException)):
        return Failure("connection", f"connection error: {type(cause).__name__}: {redact(str(cause), secrets)}")
    if isinstance(cause, BceClientError) or cause is exc:  # raised before any request was sent
        return Failure("client", f"{type(cause).__name__}: {redact(str(cause), secrets)}")
    if isinstance(cause, ValueError):  # the SDK could not parse an error response
        return Failure("server", f"unreadable response ({type(cause).__name__})")
    return Failure("client", f"{type(cause).__name__}: {redact(str(cause), secrets)}")


def _by_status(status: int | None, code: str | bytes | None) -> Failure:
    code = code.decode("utf-8", "replace") if isinstance(code, bytes) else (code or "")
    detail = f"HTTP {status} {code}".strip() if status else f"BOS error {code}".strip()
    if status == 404:
        return Failure("not_found", detail)
    if status in (401, 403):
        return Failure("denied", detail)
    if status == 429 or code in THROTTLE_CODES:
        return Failure("throttled", detail)
    if status == 408:
        return Failure("timeout", detail)
    if status is None or status >= 500:
        return Failure("server", detail)
    return Failure("client", detail)


def to_error(failure: Failure, url: str, attempts: int, elapsed: float) -> StorageError:
    """The typed, secret-free error a caller sees for ``url``."""
    tried = f"after {attempts} attempt{'s' if attempts != 1 else ''} in {elapsed:.2f}s"
    if failure.kind == "not_found":
        return FeatureNotFoundError(f"BOS object {url} does not exist ({failure.detail}).", url=url,
                                    fix="check the bucket and key; it may not be uploaded yet, or may have expired.")
    if failure.kind == "denied":
        return FeatureAccessDeniedError(
            f"BOS refused access to {url} ({failure.detail}).", url=url,
            fix="check that the AK/SK (FDPLUG_BOS_AK/FDPLUG_BOS_SK or ENCODE_FEATURE_BOS_AK/SK) may read this "
                "bucket, that an STS token (FDPLUG_BOS_STS_TOKEN) has not expired, and the endpoint's region.")
    if failure.kind == "timeout":
        return StorageTimeoutError(f"fetching {url} timed out {tried} ({failure.detail}).", url=url,
                                   fix="raise FDPLUG_FETCH_TIMEOUT, or check the network path to the BOS endpoint.")
    if failure.kind == "throttled":
        return StorageError(f"BOS kept throttling {url}: {failure.detail}, {tried}.", url=url,
                            fix="lower FD_BOS_DOWNLOAD_PARALLEL, or raise FDPLUG_BOS_MAX_RETRIES / "
                                "FDPLUG_BOS_RETRY_DEADLINE.")
    if failure.kind == "client":
        return StorageError(f"the BOS request for {url} was refused before or by the server: {failure.detail}.",
                            url=url, fix="write the URL as bos://<bucket>/<key> with a valid bucket name.")
    return StorageError(f"fetching {url} failed {tried}: {failure.detail}.", url=url,
                        fix="check the endpoint (FDPLUG_BOS_ENDPOINT / ENCODE_FEATURE_ENDPOINT) and BOS's status; "
                            "retries are set by FDPLUG_BOS_MAX_RETRIES and FDPLUG_BOS_RETRY_DEADLINE.")


# ---------------------------------------------------------------------------------------------------
# the SDK's log lines
# ---------------------------------------------------------------------------------------------------


class _RedactingFilter(logging.Filter):
    """Rewrites a baidubce log record so that no known secret or signature survives formatting."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: frozenset[str] = frozenset()
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed SDK log call: drop it rather than risk printing raw args
            return False
        record.msg, record.args = redact(message, self.secrets), None
        return True


_FILTER = _RedactingFilter()


def install_log_redaction(secrets: tuple[str, ...]) -> None:
    """Add ``secrets`` to the filter and attach it to every ``baidubce`` logger (idempotent)."""
    with _FILTER.lock:
        _FILTER.secrets = _FILTER.secrets | frozenset(s for s in secrets if s)
    names = [name for name in logging.root.manager.loggerDict if name == "baidubce" or name.startswith("baidubce.")]
    for name in names:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
