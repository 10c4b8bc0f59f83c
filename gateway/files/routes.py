"""OpenAI's Files API: `POST/GET /v1/files`, `GET/DELETE /v1/files/{id}`, `GET /v1/files/{id}/content`."""

from __future__ import annotations

import functools
import urllib.parse

from redis.exceptions import OutOfMemoryError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from common.error_codes import ErrorCode
from gateway.auth import principal_of
from gateway.errors import ApiError, store_full
from gateway.files.quota import FileQuota, OverQuota
from gateway.files.store import PURPOSES, FileInUse, FileStore, StoredFile, new_file_id
from gateway.files.upload import receive_upload
from gateway.operations import OBJECT, STRING, Operation, Param, Reply, page_of
from gateway.owned import OwnedKind, list_page, page_limit
from gateway.state import app_state

MAX_LIST = 10_000


def file_store(request: Request) -> FileStore:
    state = app_state(request)
    settings = state.settings
    quota = FileQuota(
        state.redis,
        state.keys,
        settings.key_max_stored_file_bytes,
        settings.key_max_stored_files,
        memory_share=settings.files_max_memory_share,
    )
    return FileStore(state.redis, state.keys, settings.file_ttl_s, quota)


_FILE = Reply("the file", OBJECT)
_UPLOAD = {
    "type": "object",
    "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary"}, "purpose": {"const": "batch"}},
}

FILE = OwnedKind("file", "file_id", ErrorCode.file_not_found, "file-")


async def owned_file(request: Request) -> StoredFile:
    return await FILE.from_path(request, file_store(request).get)


@Operation(
    "Upload a JSONL file (purpose batch), read as a stream; capped by max_file_bytes, and what the key "
    "keeps by key_max_stored_file_bytes and key_max_stored_files",
    request=_UPLOAD,
    request_media_type="multipart/form-data",
    responses={200: _FILE},
    errors=(400, 413, 503),
)
async def create_file(request: Request) -> Response:
    state = app_state(request)
    store = file_store(request)
    owner = principal_of(request.scope).name
    file_id = new_file_id()
    if (full := state.shards.home.watch.full_as("store 1")) is not None:  # the home store, as for jobs
        raise store_full(full)
    try:
        # held before the body is read: its Content-Length, which holds the file and its multipart frame
        await store.hold(owner, file_id, declared_bytes(request, state.settings.max_file_bytes))
        upload = await receive_upload(
            request.stream(),
            request.headers.get("content-type", ""),
            store,
            file_id,
            max_bytes=state.settings.max_file_bytes,
            max_line_bytes=state.settings.max_body_bytes,
            hold=functools.partial(store.hold, owner, file_id),
        )
        purpose = upload.fields.get("purpose")
        if purpose is None:
            raise ApiError(400, "purpose: required (batch)", param="purpose")
        if purpose not in PURPOSES:
            raise ApiError(
                400, f"purpose: {purpose!r} is not supported by ortfleet; use 'batch'", param="purpose"
            )
        if upload.filename is None:
            raise ApiError(400, "file: required, as a multipart file part named `file`", param="file")
        stored = await store.register(file_id, owner, purpose, upload.filename, upload.size, upload.lines)
    except OverQuota as e:
        await store.discard(owner, file_id)
        raise ApiError(
            400,
            f"{e}; delete files it no longer needs (DELETE /v1/files/{{file_id}}) or wait for them to expire",
            param="file",
            code=ErrorCode.file_quota_exceeded,
        ) from e
    except OutOfMemoryError:
        state.shards.home.watch.note_refused()  # submissions hear of it before the next memory reading
        await store.discard(owner, file_id)
        raise
    except BaseException:
        await store.discard(owner, file_id)
        raise
    return JSONResponse(stored.view())


def declared_bytes(request: Request, most: int) -> int:
    """The upload's Content-Length, at most `most` (the largest file); 0 for a body sent chunked."""
    length = request.headers.get("content-length", "")
    return min(int(length), most) if length.isdigit() else 0


@Operation(
    "The caller's files, newest first",
    responses={200: Reply("files", page_of("files"))},
    errors=(400,),
    params=(
        Param("limit", {"type": "integer", "minimum": 1, "maximum": MAX_LIST}),
        Param("after"),
        Param("purpose"),
    ),
)
async def list_files(request: Request) -> Response:
    limit = page_limit(request, default=MAX_LIST, most=MAX_LIST)
    purpose = request.query_params.get("purpose")
    after = FILE.page_after(request)
    owner = principal_of(request.scope).name
    found = await file_store(request).list_files(owner, purpose, limit + 1, after)
    return list_page(found, limit)


@Operation("A file's details", responses={200: _FILE}, errors=(404,))
async def get_file(request: Request) -> Response:
    return JSONResponse((await owned_file(request)).view())


@Operation(
    "Delete a file (409 while a batch that has not ended reads it)",
    responses={200: Reply("deleted", OBJECT)},
    errors=(404, 409),
)
async def delete_file(request: Request) -> Response:
    stored = await owned_file(request)
    try:
        deleted = await file_store(request).delete(stored.id, stored.owner)
    except FileInUse as e:
        raise ApiError(
            409,
            f"{e}; delete it once the batch has ended (or cancel the batch first)",
            param="file_id",
            code=ErrorCode.file_in_use,
        ) from e
    if not deleted:
        raise FILE.not_found(stored.id)
    return JSONResponse({"id": stored.id, "object": "file", "deleted": True})


@Operation(
    "A file's bytes",
    responses={200: Reply("the file", STRING, media_type="application/octet-stream")},
    errors=(404, 503),
)
async def file_content(request: Request) -> Response:
    stored = await owned_file(request)
    held = await file_store(request).line_count(stored.id)
    if held < stored.lines:  # never a partial or empty body for a file whose lines Redis lost
        raise ApiError(
            503,
            f"the content of file {stored.id!r} was lost by the job store (Redis holds {held} of its "
            f"{stored.lines} lines): it restarted without persistence, or evicted keys; upload it again",
            param="file_id",
            code=ErrorCode.store_lost,
        )
    headers = {"Content-Disposition": content_disposition(stored.filename)}
    return StreamingResponse(
        file_store(request).content(stored.id), media_type="application/octet-stream", headers=headers
    )


def content_disposition(filename: str) -> str:
    """An attachment named `filename` in any script: its UTF-8 name in RFC 5987's form, after a plain
    ASCII one for clients that know only that."""
    plain = "".join(c if " " <= c <= "~" and c not in '"\\' else "_" for c in filename)
    return f"attachment; filename=\"{plain}\"; filename*=UTF-8''{urllib.parse.quote(filename, safe='')}"


routes = [
    Route("/v1/files", create_file, methods=["POST"]),
    Route("/v1/files", list_files, methods=["GET"]),
    Route("/v1/files/{file_id}", get_file, methods=["GET"]),
    Route("/v1/files/{file_id}", delete_file, methods=["DELETE"]),
    Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
]
