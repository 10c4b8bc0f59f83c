"""Reading a multipart upload as a stream: its lines go to Redis as they arrive, so memory stays bounded
by one flush of lines plus the longest line, whatever the file's size."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from gateway.errors import ApiError
from gateway.files.store import FileStore

FLUSH_BYTES = 256 * 1024
MAX_FIELD_BYTES = 1024


@dataclass
class _Part:
    headers: dict[bytes, bytes] = field(default_factory=dict)
    name: str = ""
    filename: str | None = None
    value: bytearray = field(default_factory=bytearray)


@dataclass
class Upload:
    """What a finished upload held: its form fields and the file's size and line count."""

    fields: dict[str, str]
    filename: str | None
    size: int
    lines: int


class _Reader:
    def __init__(self, max_bytes: int, max_line_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.max_line_bytes = max_line_bytes
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.size = 0
        self.lines = 0
        self.ready: list[bytes] = []  # whole lines not yet written
        self.ready_bytes = 0
        self.partial = bytearray()  # the line being read
        self.part = _Part()
        self.header_field = bytearray()
        self.header_value = bytearray()
        self.files_seen = 0
        self.ended = False  # the closing boundary was read

    # python-multipart's callbacks
    def on_part_begin(self) -> None:
        self.part = _Part()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.header_value += data[start:end]

    def on_header_end(self) -> None:
        self.part.headers[bytes(self.header_field).lower()] = bytes(self.header_value)
        self.header_field.clear()
        self.header_value.clear()

    def on_headers_finished(self) -> None:
        _kind, options = parse_options_header(self.part.headers.get(b"content-disposition", b""))
        self.part.name = options.get(b"name", b"").decode("utf-8", "replace")
        raw_filename = options.get(b"filename")
        if raw_filename is not None and self.part.name == "file":
            self.files_seen += 1
            if self.files_seen > 1:
                raise ApiError(400, "file: give one file per upload", param="file")
            self.part.filename = raw_filename.decode("utf-8", "replace")
            if any(c < " " or c == "\x7f" for c in self.part.filename):
                raise ApiError(400, "file: the filename holds a control character", param="file")
            self.filename = self.part.filename or "upload.jsonl"

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if self.part.filename is None:
            self.part.value += chunk
            if len(self.part.value) > MAX_FIELD_BYTES:
                raise ApiError(
                    400, f"{self.part.name}: longer than {MAX_FIELD_BYTES} bytes", param=self.part.name
                )
            return
        self.size += len(chunk)
        if self.size > self.max_bytes:
            raise ApiError(
                413, f"file: larger than {self.max_bytes} bytes (ORTFLEET_MAX_FILE_BYTES)", param="file"
            )
        self._split(chunk)

    def on_part_end(self) -> None:
        if self.part.filename is None:
            self.fields[self.part.name] = self.part.value.decode("utf-8", "replace")
        elif self.partial:
            self._line(bytes(self.partial))
            self.partial.clear()

    def on_end(self) -> None:
        self.ended = True

    def _split(self, chunk: bytes) -> None:
        start = 0
        while (newline := chunk.find(b"\n", start)) >= 0:
            self.partial += chunk[start : newline + 1]
            self._line(bytes(self.partial))
            self.partial.clear()
            start = newline + 1
        self.partial += chunk[start:]
        self._check_length(len(self.partial))

    def _check_length(self, length: int) -> None:
        if length > self.max_line_bytes:
            raise ApiError(
                413,
                f"file: line {self.lines + 1} is longer than {self.max_line_bytes} bytes, the largest "
                "request body (ORTFLEET_MAX_BODY_BYTES)",
                param="file",
            )

    def _line(self, line: bytes) -> None:
        self._check_length(len(line))
        self.lines += 1
        self.ready.append(line)
        self.ready_bytes += len(line)

    def take(self) -> list[bytes]:
        taken, self.ready, self.ready_bytes = self.ready, [], 0
        return taken


def boundary_of(content_type: str) -> bytes:
    kind, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise ApiError(
            400, "the body must be multipart/form-data with a `file` and a `purpose`", param="file"
        )
    return boundary


async def receive_upload(
    body: AsyncIterator[bytes],
    content_type: str,
    store: FileStore,
    file_id: str,
    *,
    max_bytes: int,
    max_line_bytes: int,
    hold: Callable[[int], Awaitable[None]],
) -> Upload:
    """Parses the multipart body as it arrives, writing the file's lines under `file_id`; before each
    write, `hold` is given the bytes of the file read so far (it raises to refuse them).

    On any error the lines written so far are deleted and the error is raised.
    """
    reader = _Reader(max_bytes, max_line_bytes)
    callbacks = {
        "on_part_begin": reader.on_part_begin,
        "on_part_data": reader.on_part_data,
        "on_part_end": reader.on_part_end,
        "on_header_field": reader.on_header_field,
        "on_header_value": reader.on_header_value,
        "on_header_end": reader.on_header_end,
        "on_headers_finished": reader.on_headers_finished,
        "on_end": reader.on_end,
    }
    parser = MultipartParser(boundary_of(content_type), callbacks)  # type: ignore[arg-type]
    try:
        async for chunk in body:
            parser.write(chunk)
            if reader.ready_bytes >= FLUSH_BYTES:
                await hold(reader.size)
                await store.append_lines(file_id, reader.take())
        parser.finalize()
        if not reader.ended:
            raise MultipartParseError("it ends before its closing boundary")
        await hold(reader.size)
        await store.append_lines(file_id, reader.take())
    except MultipartParseError as e:
        await store.redis.delete(store.keys.file_lines(file_id))
        raise ApiError(400, f"the body is not valid multipart/form-data: {e}", param="file") from e
    except BaseException:
        await store.redis.delete(store.keys.file_lines(file_id))
        raise
    return Upload(reader.fields, reader.filename, reader.size, reader.lines)
