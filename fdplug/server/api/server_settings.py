"""``ServerSettings``: how ``fdplug serve`` was asked to run (its flags), for the launcher and the app."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from fdplug.core.parsers.chat_output import ChatParsers
from fdplug.server.http.limits import DEFAULT_STREAM_BACKLOG, ConnectionLimits
from fdplug.server.settings import DEFAULT_SHUTDOWN_TIMEOUT_S


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
    data_parallel_backend: str = "mp"
    ray_address: str | None = None
    expert_parallel_size: int = 1
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S     # SIGTERM: seconds to drain (`drain`)
    max_stream_backlog: int = DEFAULT_STREAM_BACKLOG         # a stream's unsent tokens before its client is cut
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)   # per connection (`connection_guard`)
    reasoning_parser: str | None = None      # --reasoning-parser: reasoning_content out of a thinking model's text
    tool_call_parser: str | None = None      # --tool-call-parser: the model's tool-call format
    enable_auto_tool_choice: bool = False    # --enable-auto-tool-choice: answer tools / tool_choice auto
    parsers: ChatParsers = field(default_factory=ChatParsers)   # the two, resolved by name at startup
