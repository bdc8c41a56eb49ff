"""BOS storage settings: where they come from (env, FastDeploy names too) and what a bos:// URL is.

Credentials live only in `BosSettings`, whose ``repr`` hides them, so printing the settings, a
traceback's locals in a log, or an error built from them cannot leak a key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from fdplug.errors import ConfigError, FeatureAccessDeniedError
from fdplug.plugin_api.settings import (
    Setting,
    env,
    parse_positive_float,
    parse_positive_int,
)

if TYPE_CHECKING:
    from fdplug.plugin_api.engine_config import EngineView

SETTINGS = (
    Setting("FD_BOS_DOWNLOAD_PARALLEL", 8, parse_positive_int,
            "Parallel BOS feature downloads per request (1: sequential). FastDeploy's name."),
    Setting("FDPLUG_BOS_MAX_RETRIES", 3, int,
            "Retries per BOS feature after a throttling, 5xx or connection error (0: none); never after 403/404."),
    Setting("FDPLUG_BOS_RETRY_DEADLINE", 60.0, parse_positive_float,
            "Seconds one BOS feature may spend in retries (backoff included) before it fails."),
    Setting("FDPLUG_BOS_ENDPOINT", None, str,
            "BOS endpoint for bos:// features, e.g. bj.bcebos.com (overrides ENCODE_FEATURE_ENDPOINT)."),
    Setting("FDPLUG_BOS_AK", None, str, "BOS access key id (overrides ENCODE_FEATURE_BOS_AK).", secret=True),
    Setting("FDPLUG_BOS_SK", None, str, "BOS secret access key (overrides ENCODE_FEATURE_BOS_SK).", secret=True),
    Setting("FDPLUG_BOS_STS_TOKEN", None, str, "BOS STS session token, with temporary AK/SK.", secret=True),
    Setting("ENCODE_FEATURE_ENDPOINT", None, str, "BOS endpoint for bos:// features (FastDeploy's name)."),
    Setting("ENCODE_FEATURE_BOS_AK", None, str, "BOS access key id (FastDeploy's name).", secret=True),
    Setting("ENCODE_FEATURE_BOS_SK", None, str, "BOS secret access key (FastDeploy's name).", secret=True),
)
"""Registered through ``fdplug_register_settings``; read here with ``_setting(name)``."""
_BY_NAME = {s.name: s for s in SETTINGS}

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")  # the SDK's rule, checked before any download
_URL_FIX = "write it as bos://<bucket>/<key>, e.g. bos://my-bucket/features/img_0.npy."


@dataclass(frozen=True, slots=True)
class BosSettings:
    """Everything a `BosStorage` needs; ``retry_base`` and ``retry_cap`` shape the backoff (seconds)."""

    endpoint: str
    access_key: str = field(repr=False)
    secret_key: str = field(repr=False)
    sts_token: str | None = field(default=None, repr=False)
    timeout: float = 30.0
    parallel: int = 8
    max_retries: int = 3
    retry_deadline: float = 60.0
    retry_base: float = 0.1
    retry_cap: float = 5.0

    def __post_init__(self) -> None:
        if self.parallel < 1:
            raise ConfigError(f"BOS download parallelism must be >= 1, got {self.parallel}.",
                              fix="set FD_BOS_DOWNLOAD_PARALLEL to 1 (sequential) or more.")
        if self.max_retries < 0:
            raise ConfigError(f"FDPLUG_BOS_MAX_RETRIES must be >= 0, got {self.max_retries}.",
                              fix="set it to 0 (no retries) or a small positive number such as 3.")
        if self.timeout <= 0 or self.retry_deadline <= 0:
            raise ConfigError("BOS timeouts must be > 0 seconds.",
                              fix="set FDPLUG_FETCH_TIMEOUT and FDPLUG_BOS_RETRY_DEADLINE to positive numbers.")

    def secrets(self) -> tuple[str, ...]:
        """The values that must never appear in an error or a log line."""
        return tuple(s for s in (self.access_key, self.secret_key, self.sts_token) if s)

    @classmethod
    def from_env(cls, config: EngineView | None = None) -> BosSettings:
        """Read the FDPLUG_BOS_* variables, falling back to FastDeploy's ENCODE_FEATURE_* names."""
        endpoint = _first("FDPLUG_BOS_ENDPOINT", "ENCODE_FEATURE_ENDPOINT")
        access_key = _first("FDPLUG_BOS_AK", "ENCODE_FEATURE_BOS_AK")
        secret_key = _first("FDPLUG_BOS_SK", "ENCODE_FEATURE_BOS_SK")
        missing = [name for name, value in (("FDPLUG_BOS_ENDPOINT (or ENCODE_FEATURE_ENDPOINT)", endpoint),
                                            ("FDPLUG_BOS_AK (or ENCODE_FEATURE_BOS_AK)", access_key),
                                            ("FDPLUG_BOS_SK (or ENCODE_FEATURE_BOS_SK)", secret_key)) if not value]
        if missing:
            raise ConfigError(f"bos:// features need BOS settings that are not set: {', '.join(missing)}.",
                              fix="export the endpoint (e.g. bj.bcebos.com) and an AK/SK that can read the bucket.")
        timeout = config.fetch_timeout if config is not None else env("FDPLUG_FETCH_TIMEOUT")  # the core's
        return cls(endpoint=endpoint, access_key=access_key, secret_key=secret_key,
                   sts_token=_setting("FDPLUG_BOS_STS_TOKEN") or None, timeout=timeout,
                   parallel=_setting("FD_BOS_DOWNLOAD_PARALLEL"), max_retries=_setting("FDPLUG_BOS_MAX_RETRIES"),
                   retry_deadline=_setting("FDPLUG_BOS_RETRY_DEADLINE"))


def _setting(name: str):
    return _BY_NAME[name].value()


def _first(*names: str) -> str | None:
    for name in names:
        value = _setting(name)
        if value:
            return value.strip()
    return None


@dataclass(frozen=True, slots=True)
class BosObject:
    """A parsed ``bos://bucket/key``; ``url`` is kept for messages."""

    url: str
    bucket: str
    key: str


def parse_bos_url(url: str) -> BosObject:
    """Split ``bos://<bucket>/<key/with/any/segments>``; refuse anything else with the expected form."""
    parts = urlsplit(url)
    key = parts.path.lstrip("/")
    if parts.scheme.lower() != "bos" or not parts.netloc or not key or parts.query or parts.fragment:
        raise FeatureAccessDeniedError(f"{url.split('?', 1)[0]!r} is not a BOS object URL.", url=url, fix=_URL_FIX)
    if "@" in parts.netloc:
        raise FeatureAccessDeniedError("BOS URLs must not carry credentials.", url="bos://<hidden>",
                                       fix="put the AK/SK in FDPLUG_BOS_AK/FDPLUG_BOS_SK, and " + _URL_FIX)
    if not _BUCKET_RE.match(parts.netloc):
        raise FeatureAccessDeniedError(f"{parts.netloc!r} in {url} is not a valid BOS bucket name.", url=url,
                                       fix="bucket names are 3-63 lower-case letters, digits or '-', starting and "
                                           "ending with a letter or digit; " + _URL_FIX)
    return BosObject(url, parts.netloc, key)
