"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}` with the right status.

Handlers raise `APIError`; the server's middleware turns it (and aiohttp's own HTTP errors, and
pydantic validation errors) into a JSON response. Status policy: 400 for a body that is not valid
JSON/UTF-8 or a request the server cannot honour (prompt too long for the context, empty messages),
422 for JSON that does not match the schema (wrong types, out-of-range values), 401 bad or missing
API key, 404 unknown model or route, 413 body too large, 429 queue full (with `Retry-After`),
503 engine down or server draining.
"""

from __future__ import annotations

import json
import re
from typing import Any

from aiohttp import web
from pydantic import ValidationError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|tuple|none|function-.*|.*\[.*\].*|[a-z-]+\[.*)$")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.Response(
            status=self.status,
            text=json.dumps(self.body()),
            content_type="application/json",
            headers=self.headers,
        )


def from_validation(e: ValidationError) -> APIError:
    """The first schema violation, named by its dotted field path (what OpenAI puts in `param`)."""
    errs = e.errors(include_url=False)
    first = errs[0] if errs else {"loc": (), "msg": str(e)}
    # Union members show up in the location ("prompt.str", "prompt.list[int].0"): keep the field path.
    loc = [str(p) for p in first.get("loc", ()) if not _TYPE_TAG.match(str(p))]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    return APIError(422, f"{param}: {msg}{more}" if param else f"{msg}{more}", param=param, code="invalid_value")
