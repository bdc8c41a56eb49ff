"""Pictures as multimodal items: ``image_url`` parts (data URLs, http(s)) and PIL images.

A picture's item carries its encoded bytes (PNG, JPEG, ...) to the engine, whose vision encoder
decodes, resizes and encodes it off the step loop (`fdplug.core.multimodal.loader`). Everything a
request is admitted on is known here from the header alone: the patch grid (so the placeholder
tokens, and whether they fit ``max_model_len``) and the item's identity, a hash of its bytes (so a
picture seen before hits the encoder cache and the prefix cache at once).

http(s) URLs are fetched here, through the storage that serves feature URLs (its host allow-list,
size limit and timeout), because the grid is needed before the request is admitted.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from collections.abc import Callable, Mapping
from typing import Any

from fdplug.errors import InvalidRequestError
from fdplug.plugin_api.storage import display_url

MAX_IMAGE_BYTES = 32 * 1024 * 1024
URL_FIX = ('send {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}} or an https:// URL '
           "from a host the server allows.")

UrlFetcher = Callable[[str], bytes]


def picture_hash(data: bytes) -> str:
    """A picture's identity: its bytes (the same file from two clients is one encoder-cache entry)."""
    return "p:" + hashlib.sha256(data).hexdigest()


def image_url_bytes(part: Any, name: str, fetch: UrlFetcher | None) -> bytes:
    """The bytes of an ``image_url`` part's picture (``{"url": ...}`` or the URL string itself)."""
    url = part.get("url") if isinstance(part, Mapping) else part
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"{name} needs an image_url with a 'url' string.", fix=URL_FIX, param="messages")
    if url.startswith("data:"):
        return _data_url(url, name)
    scheme = url.split(":", 1)[0].lower()
    if scheme not in ("http", "https"):
        raise InvalidRequestError(f"{name}: image URL scheme {scheme!r} is not supported (data:, http:, https: are).",
                                  fix=URL_FIX, param="messages")
    if fetch is None:
        raise InvalidRequestError(f"{name}: this server does not fetch image URLs ({display_url(url)}).",
                                  fix="send the picture inline as a data: URL.", param="messages")
    data = fetch(url)
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidRequestError(f"{name} ({display_url(url)}) is {len(data)} bytes, over the {MAX_IMAGE_BYTES} "
                                  "an image may have.", fix="send a smaller image.", param="messages")
    return data


def _data_url(url: str, name: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64") or not header[5:].startswith("image/"):
        raise InvalidRequestError(f"{name}: a data URL must be data:image/<format>;base64,<data> (got "
                                  f"{header[:40]!r}).", fix=URL_FIX, param="messages")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:    # checked before decoding anything
        raise InvalidRequestError(f"{name}: the data URL holds more than the {MAX_IMAGE_BYTES} bytes an image may "
                                  "have.", fix="send a smaller image.", param="messages")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{name}: the data URL's base64 is malformed.",
                                  fix="encode the file with standard base64 (RFC 4648).", param="messages") from None


def pil_bytes(image: Any, name: str) -> bytes:
    """A PIL image as PNG bytes (lossless: the pixels the encoder sees are the image's)."""
    if not hasattr(image, "save") or not hasattr(image, "size"):
        raise InvalidRequestError(f"{name} must be a PIL image, got {type(image).__name__}.",
                                  fix="pass a PIL.Image.Image (or an image_url part).")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()
