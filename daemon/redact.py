"""Keeping credentials out of the daemon's log, whatever a client sends.

aiohttp's HTTP parser refuses a malformed header line (a value with a bare LF or CR, a NUL, a folded
continuation line) with an error whose message quotes the raw bytes of the offending line, and logs
it at ERROR level, traceback included; an `Authorization` header broken that way would put the API
key, or whatever token a client sent, into the log. `Redactor` is a logging filter that rewrites
every record before any handler sees it: the configured API key anywhere, the value after
`Authorization:` / `Proxy-Authorization:`, the token after `Bearer` or `Basic`, and, in the records
of aiohttp's own loggers, every byte string they quote (the raw request bytes of a parser error,
whichever header they come from). The message and the formatted traceback are redacted alike; the
exception object itself is dropped from the record, since any later formatter would print its
unredacted text. `install` puts it on the loggers the daemon and aiohttp log through (a logger's
filter runs for its own records whichever handler takes them) and on the root logger's handlers
(which see everything that propagates).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

MASK = "[redacted]"
# Loggers whose records may carry request bytes: aiohttp's (the parser's errors, the access log) and
# the daemon's own; asyncio's reports unhandled exceptions of the event loop's callbacks.
LOGGERS = ("aiohttp", "aiohttp.server", "aiohttp.access", "aiohttp.web", "aiohttp.internal", "aiohttp.websocket",
           "aiohttp.client", "asyncio", "mleagle", "mleagle.daemon", "mleagle.daemon.engine")
_AUTH_VALUE = re.compile(r"(?i)(\b(?:proxy-)?authorization\b\s*[:=]\s*)[^'\"\r\n]*")
_SCHEME_TOKEN = re.compile(r"(?i)\b(bearer|basic)(\s+)(?!\[redacted\])[^\s'\",]+")
# A Python bytes literal as the HTTP parser quotes the raw line: b'...' or b"..." (escapes included).
_BYTES_LITERAL = re.compile(r"""\bb(['"])(?:\\.|(?!\1).)*\1""")


class Redactor(logging.Filter):
    """Rewrites each record's message and traceback with credentials masked; never drops a record."""

    def __init__(self, secrets: Iterable[str | None] = ()) -> None:
        super().__init__()
        # Longest first, so a key that contains another is masked whole.
        self.secrets = sorted({s for s in secrets if s}, key=len, reverse=True)

    def redact(self, text: str, raw_bytes: bool = False) -> str:
        for s in self.secrets:
            text = text.replace(s, MASK)
        if raw_bytes:
            text = _BYTES_LITERAL.sub("b'" + MASK + "'", text)
        text = _AUTH_VALUE.sub(lambda m: m.group(1) + MASK, text)
        return _SCHEME_TOKEN.sub(lambda m: m.group(1) + m.group(2) + MASK, text)

    def filter(self, record: logging.LogRecord) -> bool:
        # Idempotent: a record may pass a logger's filter and then a handler's.
        raw = record.name.startswith("aiohttp")
        try:
            msg = record.getMessage()
        except Exception:  # a malformed record: leave it to logging's own error report
            return True
        exc_text = record.exc_text
        if record.exc_info and not exc_text:
            exc_text = logging.Formatter().formatException(record.exc_info)
        record.msg, record.args = self.redact(msg, raw), None
        record.exc_info, record.exc_text = None, self.redact(exc_text, raw) if exc_text else None
        if record.stack_info:
            record.stack_info = self.redact(record.stack_info, raw)
        return True


def install(secrets: Iterable[str | None] = ()) -> Redactor:
    """Redact every record of the daemon's and aiohttp's loggers and of the root logger's handlers."""
    r = Redactor(secrets)
    for name in LOGGERS:
        logging.getLogger(name).addFilter(r)
    for h in logging.getLogger().handlers:
        h.addFilter(r)
    return r
