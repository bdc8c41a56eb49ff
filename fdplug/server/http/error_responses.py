"""OpenAI error objects as HTTP answers, for every front (`fdplug serve`'s app, `fdplug router`).

Every error a client can cause is an ``FdplugError`` and leaves as ``{"error": {message, type,
param, code}}`` with the error's ``http_status``; anything else is a bug: logged with its
traceback, answered with a 500 that reveals nothing. Unknown paths (404) and wrong methods (405)
are error objects too, not plain text.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fdplug.errors import FdplugError

logger = logging.getLogger("fdplug.server")


def error_body(message: str, error_type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(exc: FdplugError, metrics: Any = None) -> JSONResponse:
    message = exc.message + (f" Fix: {exc.fix}" if exc.fix else "")
    code = getattr(exc, "code", None) or exc.http_status
    if metrics is not None:
        metrics.http_error(exc.http_status)
    return JSONResponse(error_body(message, exc.error_type, getattr(exc, "param", None), code),
                        status_code=exc.http_status)


def guarded(handler: Callable[[Request], Awaitable[Response]],
            metrics: Any) -> Callable[[Request], Awaitable[Response]]:
    """A route whose failures are OpenAI error objects: its ``FdplugError`` with its status, anything
    else a bug (logged with its traceback, a 500 that reveals nothing)."""
    async def wrapper(request: Request) -> Response:
        try:
            return await handler(request)
        except FdplugError as exc:
            return error_response(exc, metrics)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("bug while serving %s", request.url.path)
            metrics.http_error(500)
            return JSONResponse(error_body("internal server error (a bug; the server log has the details).",
                                           "server_error", None, 500), status_code=500)
    return wrapper


def answer_unknown_routes(app: Any, metrics: Any) -> None:
    """An unknown path (404) or a wrong method (405) answered as an OpenAI error object, not plain text."""
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        metrics.http_error(exc.status_code)
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}.", kind, None,
                                       exc.status_code), status_code=exc.status_code, headers=exc.headers)

    app.add_exception_handler(StarletteHTTPException, http_error)
