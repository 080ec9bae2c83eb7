"""The tiers' vocabulary: what the store hands out (an entry's description and body) and
the interfaces between the store and a remote backend: :class:`Backend`, the data path
(entries), and :class:`BackendAdmin`, what purges, ``/stats``, ``/readyz`` and start-up
need (namespaces, life cycle); :class:`RemoteTier` is both.

:class:`Backend` plays the part of bazel-remote's ``cache.Proxy``: the local side (the
store with its disk tier and ``read_through``) owns read-through and write-through and
calls the backend; the backend stores and returns entries and knows nothing of the disk.
Every method speaks entries (:class:`~app.keys.EntryKey`), never object keys, and raises
only the server's errors (:class:`~app.errors.ECError`: 503 ``unavailable`` when the
answer is unknown, 502 otherwise).
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

from app import checksum
from app.keys import EntryKey
from app.safetensors_format import TensorHeader

#: A piece of a streamed body, in whatever buffer its source filled: sent to the client,
#: checked and written to disk as it is, never copied into another type.
Chunk = bytes | bytearray | memoryview


@dataclass(frozen=True)
class EntryInfo:
    """What ``HEAD`` shows: enough to describe an entry without its bytes."""

    size: int
    crc32c: int
    header: TensorHeader
    tier: str

    @property
    def etag(self) -> str:
        return checksum.etag(self.crc32c)

    def raw_headers(self) -> list[tuple[bytes, bytes]]:
        """The response headers, as ASGI wants them (lowercase names, bytes)."""
        return [
            (b"content-length", b"%d" % self.size),
            (b"content-type", b"application/octet-stream"),
            (b"etag", self.etag.encode()),
            (b"x-ec-crc32c", checksum.to_hex(self.crc32c).encode()),
            (b"x-ec-dtype", self.header.dtype.encode()),
            (b"x-ec-shape", self.header.shape_text.encode()),
            (b"x-ec-data-offset", b"%d" % self.header.data_offset),
            (b"x-ec-tier", self.tier.encode()),
        ]


@dataclass(frozen=True)
class EntryBody:
    """An entry ready to send: the whole body in one buffer, or a stream of chunks."""

    info: EntryInfo
    buffer: memoryview | None = None
    chunks: AsyncGenerator[Chunk, None] | None = None

    async def aclose(self) -> None:
        """Release a stream that will not be (fully) sent."""
        if self.chunks is not None:
            await self.chunks.aclose()


@dataclass(frozen=True)
class RemoteInfo:
    """What a backend knows of an entry without reading its body."""

    size: int
    #: None: the backend holds no usable checksum; only a full read can tell it.
    crc32c: int | None
    header: TensorHeader


class RemoteBody(Protocol):
    """An open read of a backend entry: size (and CRC32C, when stored) known, body in
    chunks. Chunks raise ``ECError`` when the read breaks; ``aclose`` always."""

    size: int
    crc32c: int | None
    #: The entry's header as stored metadata describes it (None: only the body can
    #: tell); the read-through answers from it before the first body byte arrives.
    header: TensorHeader | None

    def chunks(self) -> AsyncIterator[Chunk]: ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> RemoteBody: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


class RemotePut(Protocol):
    """An upload whose body is sent while it is being received (write-through).

    ``feed`` hands on received chunks (and waits while the backend lags too far
    behind); the backend holds the last bytes back until ``finish``, which the caller
    calls only once it verified the whole body, and which returns once the entry is
    stored (True), or refused because the key has an entry already (False: first
    writer wins); ``abort`` withdraws the body, leaving nothing. One of the two always."""

    async def feed(self, chunks: Sequence[bytes | memoryview]) -> None: ...

    async def finish(self) -> bool: ...

    async def abort(self) -> None: ...


class Backend(Protocol):
    """Remote persistence behind the disk tier (bazel-remote's ``cache.Proxy``): the
    data path only, entries in and out; what operators and purges need of the same
    store is :class:`BackendAdmin`. ``head`` belongs here: a client's HEAD of an entry
    only the backend holds is answered from it (``read_through``), and the write-back
    asks it which body won a race. ``put_file`` and ``begin_put`` are the one put from
    its two sources: a committed file, or a body still being received."""

    #: The ``X-EC-Tier`` of what it serves, and the label of its metrics (``s3``).
    name: str

    # -- entries -------------------------------------------------------------------
    async def head(self, key: EntryKey, *, read_header: bool = True) -> RemoteInfo | None:
        """Describe an entry without its body (None: absent). ``read_header`` False:
        from stored metadata only (None as well when that does not describe it)."""
        ...

    async def open(self, key: EntryKey) -> RemoteBody | None:
        """Start reading an entry's body (None: absent)."""
        ...

    async def contains(self, key: EntryKey) -> bool: ...

    async def put_file(
        self, key: EntryKey, path: str | os.PathLike[str], crc32c: int, header: TensorHeader
    ) -> bool:
        """Store a verified local file as the entry unless the key has one already
        (False: first writer wins); nothing is visible on failure."""
        ...

    def begin_put(
        self, key: EntryKey, size: int, crc32c: int, header: TensorHeader
    ) -> RemotePut | None:
        """Start storing an entry of ``size`` bytes and CRC32C ``crc32c`` from a body
        still being received (None: not for this size; use ``put_file``). The
        backend verifies ``crc32c`` over what it receives."""
        ...

    async def delete(self, key: EntryKey) -> None:
        """Remove an entry; absent entries are fine."""
        ...


class BackendAdmin(Protocol):
    """The backend as purges, ``/stats``, ``/readyz`` and start-up use it: namespaces
    by the backend's own names and cursors, and its life cycle."""

    # -- namespaces (listing and purge) ----------------------------------------------
    def namespace_prefix(self, model: str, dtype: str) -> str:
        """The name prefix shared by the entries of one namespace."""
        ...

    async def list_page(
        self, prefix: str, *, start_after: str | None, limit: int
    ) -> tuple[list[tuple[str, int]], str | None]:
        """(name, size) of up to ``limit`` entries under ``prefix`` after
        ``start_after``, and the ``start_after`` of the next page (None at the end)."""
        ...

    async def delete_many(self, names: Sequence[str]) -> None: ...

    # -- life cycle ----------------------------------------------------------------
    @property
    def up(self) -> bool:
        """Reachable as far as is known (for the ``ec_s3_up`` gauge)."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def readiness(self) -> str:
        """ "ok" or what an operator has to fix."""
        ...

    def describe(self) -> Mapping[str, object]:
        """A JSON summary for ``/stats``."""
        ...


class RemoteTier(Backend, BackendAdmin, Protocol):
    """A backend with its admin interface: what ``create_app`` builds (``S3Backend``)."""
