"""Bearer tokens with scopes.

Tokens are configured as entries ``name:scopes:token`` (scopes comma-separated from
``read``, ``write``, ``admin``), separated by ``;`` or newlines, ``#`` starting a
comment; from ``EC_AUTH_TOKENS`` and/or the file named by ``EC_AUTH_TOKENS_FILE``.
Only SHA-256 digests are kept and compared in constant time against every token, so
neither the time taken nor the logs reveal a token. ``admin`` implies the others.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from app.errors import ECError


class Scope(StrEnum):
    READ = "read"
    WRITE = "write"
    ADMIN = "admin"


class AnonymousAccess(StrEnum):
    NONE = "none"
    READ = "read"
    READ_WRITE = "read-write"
    ADMIN = "admin"

    @property
    def scopes(self) -> frozenset[Scope]:
        return {
            AnonymousAccess.NONE: frozenset(),
            AnonymousAccess.READ: frozenset({Scope.READ}),
            AnonymousAccess.READ_WRITE: frozenset({Scope.READ, Scope.WRITE}),
            AnonymousAccess.ADMIN: frozenset(Scope),
        }[self]


class Unauthorized(ECError):
    status_code = 401
    code = "unauthorized"

    @property
    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="ec-cache"'}


class Forbidden(ECError):
    status_code = 403
    code = "forbidden"


@dataclass(frozen=True)
class Token:
    name: str
    scopes: frozenset[Scope]
    digest: bytes


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8")).digest()


def parse_tokens(text: str, source: str) -> list[Token]:
    """Parse token entries; ``ValueError`` names the source and entry (never the secret)."""
    tokens = []
    for number, raw in enumerate(text.replace(";", "\n").splitlines(), start=1):
        line = raw.split("#", 1)[0].strip() if not raw.strip().startswith("#") else ""
        if not line:
            continue
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[0] or len(parts[2]) < 16:
            raise ValueError(
                f"{source} entry {number}: expected name:scopes:token with a token of "
                "at least 16 characters"
            )
        name, scope_text, secret = parts
        try:
            scopes = frozenset(Scope(s.strip()) for s in scope_text.split(",") if s.strip())
        except ValueError:
            raise ValueError(
                f"{source} entry {number} ({name}): scopes must be read, write or admin"
            ) from None
        if Scope.ADMIN in scopes:
            scopes = frozenset(Scope)
        tokens.append(Token(name, scopes, _digest(secret)))
    return tokens


def load_tokens(inline: str | None, file: Path | None) -> list[Token]:
    tokens = parse_tokens(inline, "EC_AUTH_TOKENS") if inline else []
    if file is not None:
        try:
            text = file.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"EC_AUTH_TOKENS_FILE {file}: {exc.strerror}") from None
        tokens += parse_tokens(text, f"EC_AUTH_TOKENS_FILE {file}")
    return tokens


@dataclass(frozen=True)
class Principal:
    """Who is asking: a token's name, or ``anonymous``."""

    name: str
    scopes: frozenset[Scope]


class Authenticator:
    def __init__(self, tokens: list[Token], anonymous: AnonymousAccess) -> None:
        self._tokens = tokens
        self._anonymous = Principal("anonymous", anonymous.scopes)

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def identify(self, authorization: str | None) -> Principal:
        """The principal behind an ``Authorization`` header; 401 for a bad token."""
        if authorization is None:
            return self._anonymous
        scheme, _, secret = authorization.partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise Unauthorized("Authorization must be 'Bearer <token>'")
        digest = _digest(secret.strip())
        found = None
        for token in self._tokens:  # compare with every token: no early exit
            if hmac.compare_digest(digest, token.digest):
                found = token
        if found is None:
            raise Unauthorized("unknown token")
        return Principal(found.name, found.scopes)

    def authorize(self, authorization: str | None, scope: Scope) -> Principal:
        principal = self.identify(authorization)
        if scope in principal.scopes:
            return principal
        if principal is self._anonymous:
            raise Unauthorized(f"this request needs a token with the {scope} scope")
        raise Forbidden(f"token {principal.name!r} lacks the {scope} scope")
