"""Bearer tokens with scopes, optionally limited to model namespaces.

Tokens are configured as entries ``name:scopes:token``, separated by ``;`` or newlines,
``#`` starting a comment; from ``EC_AUTH_TOKENS`` and/or the file named by
``EC_AUTH_TOKENS_FILE``. ``scopes`` is a comma-separated list of ``read``, ``write``,
``admin`` (which implies the others) and, to limit the token to some models,
``model=PATTERN`` items::

    ops:admin:0123456789abcdef0123           # every namespace, as before
    qwen-team:read,write,model=Qwen/*:...     # only models matching Qwen/*
    llava:read,model=llava-hf/**,model=liuhaotian/*:...

A pattern is matched against the whole model name: ``*`` matches any characters
within one ``/``-separated segment, ``**`` any characters across segments. A token
with at least one ``model=`` item may touch only the models matching one of them, on
every route that names a model (entries, batch existence, namespace listing, purge);
routes of the whole server (``/stats``, ``/metrics``) need a token without ``model=``
items when they need a token at all. Only SHA-256 digests of the secrets are kept and
compared in constant time against every token, so neither the time taken nor the
logs reveal a token.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field
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


_PATTERN_RE = re.compile(r"[A-Za-z0-9._@+\-*/]+")


@dataclass(frozen=True)
class ModelPattern:
    """A ``model=`` pattern; ``*`` within a segment, ``**`` across segments."""

    text: str
    regex: re.Pattern[str] = field(compare=False, repr=False)

    @classmethod
    def parse(cls, text: str) -> ModelPattern:
        if not _PATTERN_RE.fullmatch(text) or any(
            part in ("", ".", "..") for part in text.split("/")
        ):
            raise ValueError(f"model pattern {text!r} is not a model name with * or **")
        regex = "".join(
            "[^/]*" if token == "*" else ".*" if token == "**" else re.escape(token)
            for token in re.split(r"(\*\*|\*)", text)
            if token
        )
        return cls(text, re.compile(regex))

    def matches(self, model: str) -> bool:
        return self.regex.fullmatch(model) is not None


@dataclass(frozen=True)
class Token:
    name: str
    scopes: frozenset[Scope]
    digest: bytes
    #: Empty: every model. Otherwise the token may touch only matching models.
    models: tuple[ModelPattern, ...] = ()


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
        scope_set: set[Scope] = set()
        models: list[ModelPattern] = []
        for item in (s.strip() for s in scope_text.split(",")):
            try:
                if item.startswith("model="):
                    models.append(ModelPattern.parse(item.removeprefix("model=")))
                elif item:
                    scope_set.add(Scope(item))
            except ValueError as exc:
                detail = (
                    str(exc)
                    if item.startswith("model=")
                    else "scopes must be read, write, admin or model=PATTERN"
                )
                raise ValueError(f"{source} entry {number} ({name}): {detail}") from None
        scopes = frozenset(Scope) if Scope.ADMIN in scope_set else frozenset(scope_set)
        tokens.append(Token(name, scopes, _digest(secret), tuple(models)))
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
    #: Empty: every model (see ``Token.models``).
    models: tuple[ModelPattern, ...] = ()

    @property
    def unrestricted(self) -> bool:
        return not self.models

    def may_access(self, model: str) -> bool:
        return not self.models or any(p.matches(model) for p in self.models)

    def check_model(self, model: str) -> None:
        """403 unless this principal may touch ``model``."""
        if not self.may_access(model):
            raise Forbidden(f"token {self.name!r} may not access model {model!r}")

    def check_unrestricted(self, what: str) -> None:
        """403 for a token limited to some models (``what`` spans every model)."""
        if self.models:
            raise Forbidden(f"token {self.name!r} is limited to some models: {what} spans all")


class Authenticator:
    def __init__(self, tokens: list[Token], anonymous: AnonymousAccess) -> None:
        self._tokens = tokens
        self._anonymous = Principal("anonymous", anonymous.scopes)

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
        return Principal(found.name, found.scopes, found.models)

    def authorize(
        self, authorization: str | None, scope: Scope, model: str | None = None
    ) -> Principal:
        """The principal, once it holds ``scope`` (and may touch ``model`` when given)."""
        principal = self.identify(authorization)
        if scope not in principal.scopes:
            if principal is self._anonymous:
                raise Unauthorized(f"this request needs a token with the {scope} scope")
            raise Forbidden(f"token {principal.name!r} lacks the {scope} scope")
        if model is not None:
            principal.check_model(model)
        return principal
