"""Reading a request body safely: its size, its time, UTF-8, strict JSON, nesting, Unicode, huge integers.

`read_json` is the one way a route gets its body. It answers 413 past `max_body_bytes`, 408 when the
body does not arrive within `body_timeout_s` (a client announcing more bytes than it sends), 400 for a
body its `Content-Encoding` cannot decode (`Content-Encoding: gzip` on bytes that are not gzip), and
400 for what is not a JSON object in strict JSON: invalid UTF-8, `NaN`/`Infinity` (Python's json accepts
them, JSON does not), nesting deeper than `MAX_DEPTH` (or so deep that the parser itself gives up),
and lone surrogates (`"\\ud800"` is valid JSON text but not Unicode: it cannot be encoded, tokenized
or sent to the engine), each named by its dotted path in `param` ("stop.1", "messages.0.content").
An integer literal longer than `MAX_INT_DIGITS` is not converted (CPython refuses beyond 4300 digits,
and converting is quadratic): it becomes a stand-in of the same sign far beyond every range this API
accepts, so the schema refuses it with the field's own name and range.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from mleagle.daemon.errors import APIError

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # aiohttp's own dependency before 3.11
    from async_timeout import timeout

MAX_DEPTH = 100  # any OpenAI request nests far less; pydantic and the protocol never see deeper
MAX_INT_DIGITS = 64
HUGE = 10**MAX_INT_DIGITS  # beyond int64 and every `le` of the schema
THREAD_BYTES = 256 << 10  # parse bodies larger than this off the event loop


def _parse_int(s: str) -> int:
    digits = len(s) - (s[0] == "-")
    if digits <= MAX_INT_DIGITS:
        return int(s)
    return -HUGE if s[0] == "-" else HUGE


def _no_constant(s: str) -> Any:
    raise ValueError(f"{s} is not valid JSON (numbers must be finite)")


def _path(parts: list[str | int]) -> str | None:
    return ".".join(map(str, parts)) or None


def _check_tree(body: Any) -> None:
    """Depth and Unicode, iteratively (no recursion on hostile input); the first problem found wins."""
    stack: list[tuple[Any, list[str | int]]] = [(body, [])]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise APIError(400, f"{_path(path) or 'a string'}: lone surrogate {v[e.start]!r} at index "
                                   f"{e.start} is not valid Unicode", param=_path(path), code="invalid_unicode") from None
            continue
        if not isinstance(v, (dict, list)):
            continue
        if len(path) >= MAX_DEPTH:
            top = _path(path[:1])
            raise APIError(400, f"JSON nested more than {MAX_DEPTH} levels deep" + (f" in {top}" if top else ""),
                           param=top, code="json_too_deep")
        if isinstance(v, dict):
            for k, x in v.items():
                if not k.isascii():
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        raise APIError(400, "an object key holds a lone surrogate, which is not valid Unicode",
                                       param=_path(path), code="invalid_unicode") from None
                stack.append((x, [*path, k]))
        else:
            stack.extend((x, [*path, i]) for i, x in enumerate(v))


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})", code="invalid_utf8") from None
    try:
        body = json.loads(text, parse_int=_parse_int, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, "request body nests JSON too deeply to parse", code="json_too_deep") from None
    except ValueError as e:  # JSONDecodeError and the refusals above
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    _check_tree(body)
    return body


async def read_json(request: web.Request, max_bytes: int, timeout_s: float) -> dict[str, Any]:
    if request.content_length is not None and request.content_length > max_bytes:
        raise APIError(413, f"request body is {request.content_length} bytes; the limit is {max_bytes}",
                       code="body_too_large")
    try:
        # `timeout`, not `wait_for`: before Python 3.12 `wait_for` runs the read in a task of its own,
        # so even a body that is all there already costs the route a pass of the event loop, behind
        # whatever else it runs (on the 2-core VM at 32 streams, most of a millisecond of its TTFT)
        async with timeout(timeout_s):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes", code="body_too_large") from None
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g}s", code="body_timeout",
                       headers={"Connection": "close"}) from None
    except (RequestPayloadError, HttpProcessingError) as e:
        # A body its Content-Encoding cannot decode (not gzip, truncated), or a chunked framing error:
        # the client's fault. The payload stream is broken now: mark it ended, so aiohttp does not try
        # to drain the rest after the response (and log that as an unhandled exception), and close
        # the connection (its remaining bytes cannot be read as a next request).
        request.content.feed_eof()
        enc = request.headers.get("Content-Encoding")
        cause = e.__cause__ if isinstance(e.__cause__, HttpProcessingError) else e
        why = str(getattr(cause, "message", "") or cause).strip() or type(cause).__name__
        msg = f"the request body is not valid {enc} (Content-Encoding: {enc})" if enc else \
            f"the request body cannot be read: {why}"
        raise APIError(400, msg, code="invalid_body_encoding", headers={"Connection": "close"}) from None
    if len(raw) > THREAD_BYTES:
        return await asyncio.to_thread(parse_json, raw)
    return parse_json(raw)
