"""What one HTTP client may hold of a server (`fdplug serve`, `fdplug router`): its connection's
limits (enforced by `connection_guard`) and its stream's unsent output (`request_stream.BacklogQueue`).

Plain data, no uvicorn: the CLI builds its flags from these without loading the server.
"""

from __future__ import annotations

from dataclasses import dataclass

# tokens (each logprob alternative one) a stream may hold for a client that does not read: ~2-3 MB
# with logprobs, far more than a reading client ever leaves behind (its writer takes all at once)
DEFAULT_STREAM_BACKLOG = 16384


@dataclass(slots=True)
class ConnectionLimits:
    """What one client connection may hold of the API process; a timeout of 0 turns that timeout off.

    - ``max_header_bytes`` (64 KiB): request line and header lines, as sent. OpenAI clients send under 2 KiB;
      64 KiB is 8x nginx's default buffer, and all that reading a head may cost before its 431.
    - ``max_header_count`` (100): Apache's ``LimitRequestFields``; a real client sends about 10.
    - ``idle_timeout`` (5 s): no request in progress (nothing sent yet, or between keep-alive requests):
      closed. uvicorn's keep-alive default; an idle socket costs a descriptor and buffers.
    - ``request_timeout`` (30 s): from a request's first byte until its whole body has arrived (slowloris,
      stalled uploads), then a 408. Time the server itself holds reading back is not counted.
    - ``write_timeout`` (30 s): output is pending (writes paused by flow control, or a closing connection)
      and the client acknowledges none of it for this long (checked each period, so 1x-2x): aborted, and
      the app sees ``http.disconnect``. A slow reader still makes progress: it is not cut.
    """

    max_header_bytes: int = 64 * 1024
    max_header_count: int = 100
    idle_timeout: float = 5.0
    request_timeout: float = 30.0
    write_timeout: float = 30.0

    def __post_init__(self) -> None:
        if min(self.max_header_bytes, self.max_header_count) < 1 or min(
                self.idle_timeout, self.request_timeout, self.write_timeout) < 0:
            raise ValueError(f"header limits must be at least 1 and timeouts 0 (off) or more: {self}")
