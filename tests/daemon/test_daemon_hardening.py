"""Issue 22 against a real `mleagle serve` (the tiny random model, an API key from the environment):
no credential in any log line, whatever a malformed `Authorization` header looks like; a body that is
not the gzip it claims to be is a 400 on every generation route; a request carrying `Authorization`
twice is refused.
"""

from __future__ import annotations

import gzip
import json
import time
from typing import Any

import pytest

from tests.daemon_helpers import ServerProc, raw_http

KEY = "hardening-key-7c2d9e41"
OTHER = "someone-elses-token-b83f"  # a credential the server does not know: it must not be logged either
BODY = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).encode()
ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def srv():
    s = ServerProc("--config", "tiny-dummy", "--threads", "1", "--max-running-requests", "4",
                   env={"MLEAGLE_API_KEY": KEY})
    s.api_key = KEY
    s.wait_healthy(60)
    yield s
    assert s.terminate() == 0, s.log()


def request(srv: ServerProc, path: str, headers: list[bytes], body: bytes = BODY) -> bytes:
    host = srv.url.removeprefix("http://")
    head = [f"POST {path} HTTP/1.1".encode(), f"Host: {host}".encode(), b"Content-Type: application/json",
            f"Content-Length: {len(body)}".encode(), b"Connection: close", *headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def check_error(st: int, body: bytes, want_status: int, code: str) -> dict[str, Any]:
    assert st == want_status, (st, body[:300])
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code and err["message"], err
    return err


def wait_log(srv: ServerProc, needle: str, n: int, timeout: float = 10.0) -> str:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        text = "\n".join(srv.lines)
        if text.count(needle) >= n:
            return text
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} {needle!r} in the log:\n" + srv.log())


# A header line the HTTP parser refuses, each carrying a credential: the key followed by a bare LF,
# a bare CR, a NUL; the key on a folded continuation line; and the same with a key the server does not know.
MALFORMED = [
    b"Authorization: Bearer " + KEY.encode() + b"\nX-Next: 1",
    b"Authorization: Bearer " + KEY.encode() + b"\rjunk",
    b"Authorization: Bearer " + KEY.encode() + b"\x00",
    b"Authorization: Bearer\r\n " + KEY.encode(),
    b"Authorization: Bearer " + KEY.encode() + b"\r\n continued",
    b"Authorization: Bearer " + OTHER.encode() + b"\n",
    b"Authorization: Basic\r\n\t" + OTHER.encode(),
]


async def test_malformed_authorization_is_never_logged(srv: ServerProc) -> None:
    before = "\n".join(srv.lines).count("Error handling request")
    for line in MALFORMED:
        st, _, body = await raw_http(srv.url, request(srv, "/generate", [line]))
        assert st == 400, (line, st, body[:200])
    # The parser's errors are still logged (an operator sees the bad requests), with the bytes masked.
    text = wait_log(srv, "Error handling request", before + len(MALFORMED))
    assert KEY not in text and OTHER not in text, [ln for ln in srv.lines if KEY in ln or OTHER in ln][:3]
    assert "[redacted]" in text
    # The server is unharmed, and the key still works.
    st, _, body = await raw_http(srv.url, request(srv, "/generate", [f"Authorization: Bearer {KEY}".encode()]))
    assert st == 200, body[:200]


async def test_body_that_is_not_gzip_is_400(srv: ServerProc) -> None:
    auth = f"Authorization: Bearer {KEY}".encode()
    for path in ROUTES:
        for bad in (BODY, b"\x1f\x8b" + b"\x00" * 30):  # not gzip at all; gzip's magic, then garbage
            st, _, body = await raw_http(srv.url, request(srv, path, [auth, b"Content-Encoding: gzip"], bad))
            err = check_error(st, body, 400, "invalid_body_encoding")
            assert "gzip" in err["message"], err
    # A body that is gzip is read as before.
    st, _, body = await raw_http(srv.url, request(srv, "/generate", [auth, b"Content-Encoding: gzip"],
                                                  gzip.compress(BODY)))
    assert st == 200 and len(json.loads(body)["token_ids"]) == 2, body[:200]
    st, m = srv.get("/metrics")
    assert 'status="500"' not in m
    assert "unhandled error" not in srv.log() and "Unhandled exception" not in srv.log()


async def test_duplicate_authorization_is_refused(srv: ServerProc) -> None:
    good, bad = f"Authorization: Bearer {KEY}".encode(), b"Authorization: Bearer wrong"
    for path in ROUTES:
        for pair in ([good, bad], [bad, good], [good, good]):
            st, _, body = await raw_http(srv.url, request(srv, path, pair))
            check_error(st, body, 400, "duplicate_authorization")
    st, _, body = await raw_http(srv.url, request(srv, "/generate", [good]))
    assert st == 200, body[:200]
    st, _, body = await raw_http(srv.url, request(srv, "/generate", [bad]))
    check_error(st, body, 401, "invalid_api_key")
