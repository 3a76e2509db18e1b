"""What ``kvrag serve`` is told at start: the model's public name, how a request finds its tenant,
and the limits every request is held to before any work is done for it.

A tenant is a cache namespace of the engine (``namespace=`` of every engine call): chunk KV, prefix
blocks and conversations of one tenant are never seen by another (vLLM's ``cache_salt`` plays the
same part). A request's tenant comes from, in order:

1. its API key (``Authorization: Bearer KEY``), when the server has an API-key map: the key's
   namespace; a missing or unknown key is refused (401) before the body is read;
2. else, only when the server trusts it (``trust_header``, ``--trust-tenant-header``: a gateway in
   front of the server authenticates users and sets it), the tenant header (``X-Kvrag-Tenant``);
   an untrusted server refuses a request that sends it (400) rather than share a cache silently;
3. else the engine config's ``namespace``: one shared cache, the default.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvrag.errors import InvalidRequestError

__all__ = ["ServerSettings", "TenantMap", "Limits", "AuthenticationError", "LimitError"]

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: Longest tenant name a header may choose.
MAX_TENANT_CHARS = 128


class AuthenticationError(InvalidRequestError):
    """A request's API key is missing or unknown (HTTP 401)."""


class LimitError(InvalidRequestError):
    """A request is over one of the server's :class:`Limits` (HTTP 400, or 413 for the body).

    Attributes:
        limit: the name of the setting (a :class:`Limits` field, ``--max-...`` on the command line).
        param: the request field at fault, if one is.
    """

    def __init__(self, message: str, *, limit: str, param: str | None = None) -> None:
        self.limit, self.param = limit, param
        super().__init__(f"{message} (limit {limit}; kvrag serve --{limit.replace('_', '-')})")


@dataclass(frozen=True, slots=True)
class TenantMap:
    """How a request's headers name its tenant (see the module docstring).

    Attributes:
        api_keys: API key -> namespace. Non-empty: every request needs one of these keys.
        header: the header whose value is the namespace, when trusted.
        trust_header: take ``header`` as the tenant when there are no API keys (a gateway sets it).
            Off: a request that sends it is refused, and every request uses the default namespace.
    """

    api_keys: Mapping[str, str] = field(default_factory=dict)
    header: str = "X-Kvrag-Tenant"
    trust_header: bool = False

    def __post_init__(self) -> None:
        for key, namespace in self.api_keys.items():
            if not isinstance(key, str) or not key or not isinstance(namespace, str) or not namespace:
                raise InvalidRequestError("api_keys maps non-empty key strings to non-empty namespace strings")
        if not isinstance(self.header, str) or not self.header:
            raise InvalidRequestError(f"header must be a header name, got {self.header!r}")

    @property
    def keyed(self) -> bool:
        """Whether every request needs an API key."""
        return bool(self.api_keys)

    def namespace(self, headers: Mapping[str, str]) -> str | None:
        """The tenant of a request with these (lower-case) headers; ``None`` = the default namespace.

        Raises:
            AuthenticationError: the server has API keys and the request brings none of them.
            InvalidRequestError: a tenant header the server does not trust, or an unusable one.
        """
        if self.api_keys:
            scheme, _, key = (headers.get("authorization") or "").partition(" ")
            namespace = self.api_keys.get(key.strip()) if scheme.lower() == "bearer" else None
            if namespace is None:
                raise AuthenticationError("missing or unknown API key (send it as Authorization: Bearer KEY)")
            return namespace
        value = headers.get(self.header.lower())
        if value is None:
            return None
        if not self.trust_header:
            raise InvalidRequestError(
                f"{self.header}: this server does not take tenants from a header (start it with "
                "--trust-tenant-header behind a gateway that sets it, or give tenants API keys)"
            )
        if not value or len(value) > MAX_TENANT_CHARS or _CONTROL.search(value):
            raise InvalidRequestError(f"{self.header}: a tenant is 1 to {MAX_TENANT_CHARS} printable characters")
        return value


def _limit(default: int, help: str) -> int:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request may bring; each is checked before any work is done for the request, and a
    request over one is answered with an error naming it (413 for the body, else 400).

    The defaults fit a long-context RAG request (a 128K-token prompt is about 512 KB of text).
    """

    max_body_bytes: int = _limit(8 << 20, "bytes of a request body (413 past it, read or announced)")
    max_stop_strings: int = _limit(16, "stop strings of a request")
    max_stop_chars: int = _limit(256, "characters of one stop string")
    max_documents: int = _limit(512, "documents of a request")
    max_document_bytes: int = _limit(1 << 20, "UTF-8 bytes of one document")
    max_messages: int = _limit(1024, "chat messages of a request")
    max_message_bytes: int = _limit(2 << 20, "UTF-8 bytes of one message")
    max_prompt_bytes: int = _limit(4 << 20, "UTF-8 bytes of the prompt (rendered chat), before it is split")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"{f.name} must be a positive integer, got {value!r}")

    @classmethod
    def described(cls) -> dict[str, str]:
        """Each limit's name and what it bounds (the command line's flags)."""
        return {f.name: f.metadata["help"] for f in dataclasses.fields(cls)}


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Settings of ``kvrag serve`` beyond the engine's own config.

    Attributes:
        model_name: the model's name in responses and ``/v1/models`` (default: the engine's).
            Requests may name it or ``default``; any other name is answered with 404.
        tenants: how requests find their tenant.
        limits: what one request may bring.
        retry_after_s: ``Retry-After`` sent with an overload answer (503).
    """

    model_name: str | None = None
    tenants: TenantMap = field(default_factory=TenantMap)
    limits: Limits = field(default_factory=Limits)
    retry_after_s: int = 1
