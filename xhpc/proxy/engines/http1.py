"""An engine's HTTP/1.1 answer, read strictly: the grammar and the limits it is held to.

``AnswerParser`` parses one answer to one request from its bytes as they arrive, with no I/O of
its own; a subclass takes the head (``_on_head``), the body's bytes (``_on_body``) and its end
(``_on_done``). Whatever is outside the grammar below raises ``MalformedAnswer``, and the
connection it came on cannot be trusted any more: its caller closes it.

- the status line is ``HTTP/1.0`` or ``HTTP/1.1``, a space, three digits (100-599), and an
  optional space and reason; interim answers (1xx) are skipped, at most ``MAX_INTERIM`` of them,
  and never ``101 Switching Protocols`` (the proxy asks for no upgrade);
- a header line is ``token ":" OWS value OWS``: no space before the colon, no folded lines, no
  control characters but tab; at most ``MAX_LINE`` bytes a line, ``MAX_HEADERS`` lines and
  ``MAX_HEAD`` bytes a head (trailers alike);
- the body is framed by ``Transfer-Encoding: chunked`` (exactly that: any other coding, a list of
  them, a repeated header, one with ``Content-Length`` too or in an HTTP/1.0 answer is refused),
  else by one ``Content-Length`` of at most 18 digits (two of them, even equal, or a list are
  refused), else by the end of the connection (which then is not reused);
- a chunk is ``1*16HEXDIG [BWS ";" extension] CRLF data CRLF``; nothing else is a chunk size
  (``-6``, ``0x5``, ``+5``, ``0_5``, `` 5`` are not); the last chunk is ``0``, its trailers are
  header lines, and an empty line ends the answer.
"""

from __future__ import annotations

import re

from multidict import CIMultiDict

MAX_LINE = 8 * 1024  # a status, header, trailer or chunk-size line
MAX_HEAD = 64 * 1024  # a status line and its headers (and an answer's trailers)
MAX_HEADERS = 100  # header lines in a head (and trailer lines)
MAX_INTERIM = 8  # 1xx answers before the real one
MAX_LENGTH_DIGITS = 18  # a Content-Length (under 1 EB)

HEAD, LENGTH, CHUNK_SIZE, CHUNK_DATA, CHUNK_END, TRAILER, UNTIL_CLOSE, DONE = range(8)

_STATUS = re.compile(r"HTTP/1\.([01]) ([1-5][0-9][0-9])(?: [\t\x20-\x7e\x80-\xff]*)?")
_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_VALUE = r"[\t\x20-\x7e\x80-\xff]*"  # no CR, LF, NUL or other control characters
_FIELDS = re.compile(rf"(?:{_TOKEN}:{_VALUE}\r\n)*{_TOKEN}:{_VALUE}")
_FIELD = re.compile(rf"{_TOKEN}:{_VALUE}".encode("latin-1"))
_HEX = b"0123456789abcdefABCDEF"
_CHUNK = re.compile(rb"([0-9A-Fa-f]{1,16})(?:[ \t]*;[\t\x20-\x7e\x80-\xff]*)?")


class MalformedAnswer(ValueError):
    """An answer outside the grammar or the limits; the message says where."""


def _chunk_size(line: bytes) -> int:
    """A chunk-size line's size (``1*16HEXDIG [BWS ";" extension]``)."""
    if len(line) > MAX_LINE:
        raise MalformedAnswer(f"a chunk-size line is longer than {MAX_LINE} bytes")
    match = _CHUNK.fullmatch(line)
    if match is None:
        raise MalformedAnswer(f"not a chunk size: {line[:40]!r}")
    return int(match[1], 16)


class AnswerParser:
    """One answer being parsed: ``status``, ``headers`` and ``keep_alive`` once its head is in."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.keep_alive = True
        self.received = 0  # bytes of the answer seen so far (interim answers included)
        self._state = HEAD
        self._buf = b""  # what came and is not parsed yet
        self._scan = 0  # how far into ``_buf`` the search for the end of a line already went
        self._left = 0  # bytes left in the body (Content-Length) or the chunk
        self._interim = 0
        self._trailers = 0  # bytes of trailer lines
        self._trailer_lines = 0

    # --- what a subclass takes --------------------------------------------------------------

    def _on_head(self) -> None:
        """The answer's status and headers are in (its body may be done already)."""

    def _on_body(self, data: bytes) -> None:
        """Bytes of the body, in order."""

    def _on_done(self) -> None:
        """The answer is whole."""

    # --- parsing ------------------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Parse ``data``, the next bytes of the connection; ``MalformedAnswer`` if it breaks
        the grammar or a limit (nothing more may be fed then)."""
        self.received += len(data)
        buf = self._buf + data if self._buf else data
        pos = 0
        end = len(buf)
        scan = self._scan  # where the first search for a line's end may start
        self._scan = 0
        while pos < end:
            state = self._state
            if state == CHUNK_DATA:
                take = min(self._left, end - pos)
                self._on_body(buf[pos : pos + take] if take < end - pos or pos else buf)
                pos += take
                self._left -= take
                if self._left == 0:
                    self._state = CHUNK_END
            elif state == CHUNK_SIZE:
                eol = buf.find(b"\r\n", scan if scan > pos else pos)
                if eol < 0:
                    self._waiting(end - pos, MAX_LINE, "a chunk-size line")
                    self._scan = end - pos - 1
                    break
                line = buf[pos:eol]
                pos = eol + 2
                # hex digits only: int() takes them as they are (else: an extension, or refused)
                size = int(line, 16) if 0 < len(line) <= 16 and not line.strip(_HEX) else -1
                if size < 0:
                    size = _chunk_size(line)
                if size == 0:
                    self._state = TRAILER
                else:
                    self._left = size
                    self._state = CHUNK_DATA
            elif state == CHUNK_END:
                if end - pos < 2:
                    if buf[pos : pos + 1] != b"\r":
                        raise MalformedAnswer("a chunk does not end with CRLF")
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise MalformedAnswer("a chunk does not end with CRLF")
                pos += 2
                self._state = CHUNK_SIZE
            elif state == LENGTH:
                take = min(self._left, end - pos)
                self._on_body(buf[pos : pos + take] if take < end - pos or pos else buf)
                pos += take
                self._left -= take
                if self._left == 0:
                    self._done()
            elif state == HEAD:
                stop = buf.find(b"\r\n\r\n", scan if scan > pos else pos)
                if stop < 0:
                    self._waiting(end - pos, MAX_HEAD, "the answer's head")
                    last = buf.rfind(b"\r\n", pos)
                    self._waiting(end - (last + 2 if last >= 0 else pos), MAX_LINE, "a line")
                    self._scan = end - pos - 3
                    break
                self._parse_head(buf[pos:stop])
                pos = stop + 4
            elif state == TRAILER:
                eol = buf.find(b"\r\n", scan if scan > pos else pos)
                if eol < 0:
                    self._waiting(end - pos, MAX_LINE, "a trailer line")
                    self._scan = end - pos - 1
                    break
                if eol == pos:
                    self._done()
                else:
                    self._trailer(buf[pos:eol])
                pos = eol + 2
            elif state == UNTIL_CLOSE:
                self._on_body(buf[pos:] if pos else buf)
                pos = end
            else:  # DONE: bytes after the answer; the connection is out of step
                self.keep_alive = False
                pos = end
        self._buf = buf[pos:] if pos < end else b""
        if self._scan < 0:
            self._scan = 0

    def eof(self) -> bool:
        """The connection ended: True if that ends the answer (one framed by the close)."""
        if self._state == UNTIL_CLOSE:
            self._done()
            return True
        return self._state == DONE

    def _done(self) -> None:
        self._state = DONE
        self._on_done()

    @staticmethod
    def _waiting(size: int, limit: int, what: str) -> None:
        if size > limit:
            raise MalformedAnswer(f"{what} is longer than {limit} bytes")

    def _trailer(self, line: bytes) -> None:
        self._trailers += len(line) + 2
        self._trailer_lines += 1
        if len(line) > MAX_LINE or _FIELD.fullmatch(line) is None:
            raise MalformedAnswer(f"a malformed trailer line: {line[:40]!r}")
        if self._trailers > MAX_HEAD or self._trailer_lines > MAX_HEADERS:
            raise MalformedAnswer("the answer's trailers are too large")

    def _parse_head(self, raw: bytes) -> None:
        if len(raw) > MAX_HEAD:
            raise MalformedAnswer(f"the answer's head is larger than {MAX_HEAD} bytes")
        text = raw.decode("latin-1")
        first, _, block = text.partition("\r\n")
        status_line = _STATUS.fullmatch(first) if len(first) <= MAX_LINE else None
        if status_line is None:
            raise MalformedAnswer(f"not an HTTP/1.x status line: {first[:40]!r}")
        pairs: list[tuple[str, str]] = []
        if block:
            if _FIELDS.fullmatch(block) is None:
                raise MalformedAnswer("a malformed header line")
            lines = block.split("\r\n")
            if len(lines) > MAX_HEADERS:
                raise MalformedAnswer(f"more than {MAX_HEADERS} header lines")
            for line in lines:
                if len(line) > MAX_LINE:
                    raise MalformedAnswer(f"a header line is longer than {MAX_LINE} bytes")
                name, _, value = line.partition(":")
                pairs.append((name, value.strip(" \t")))
        status = int(status_line[2])
        if status < 200:
            self._interim += 1
            if status == 101 or self._interim > MAX_INTERIM:
                raise MalformedAnswer(f"an unexpected interim answer ({status})")
            return  # (100 Continue, 103 Early Hints): the real answer follows
        headers = CIMultiDict(pairs)
        self._framing(status, headers, http11=status_line[1] == "1")
        self.status = status
        self.headers = headers
        self._on_head()

    def _framing(self, status: int, headers: CIMultiDict[str], *, http11: bool) -> None:
        """Where the body ends, and whether the connection may serve another request."""
        connection = headers.getall("Connection", None)
        tokens = {t.strip().lower() for t in ",".join(connection).split(",")} if connection else ()
        self.keep_alive = "close" not in tokens if http11 else "keep-alive" in tokens
        codings = headers.getall("Transfer-Encoding", None)
        lengths = headers.getall("Content-Length", None)
        if codings is not None:
            if len(codings) > 1 or codings[0].lower() != "chunked":
                raise MalformedAnswer(f"unsupported Transfer-Encoding {', '.join(codings)!r}")
            if not http11:
                raise MalformedAnswer("Transfer-Encoding in an HTTP/1.0 answer")
            if lengths is not None:
                raise MalformedAnswer("both Transfer-Encoding and Content-Length")
        elif lengths is not None:
            length = lengths[0]
            if len(lengths) > 1:
                raise MalformedAnswer("more than one Content-Length")
            if not (0 < len(length) <= MAX_LENGTH_DIGITS and length.isascii() and length.isdigit()):
                raise MalformedAnswer(f"not a Content-Length: {length[:40]!r}")
        if status in (204, 304):
            self._done()
        elif codings is not None:
            self._state = CHUNK_SIZE
        elif lengths is not None:
            self._left = int(lengths[0])
            self._state = LENGTH
            if self._left == 0:
                self._done()
        else:
            self._state = UNTIL_CLOSE
            self.keep_alive = False
