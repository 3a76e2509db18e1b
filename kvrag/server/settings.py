"""What ``kvrag serve`` is told at start: the model's public name and how a request finds its tenant.

A tenant is a cache namespace of the engine (``namespace=`` of every engine call): chunk KV, prefix
blocks and conversations of one tenant are never seen by another (vLLM's ``cache_salt`` plays the
same part). A request's tenant comes from, in order:

1. its API key (``Authorization: Bearer KEY``), when the server has an API-key map: the key's
   namespace; a missing or unknown key is refused (401);
2. else the tenant header (``X-Kvrag-Tenant`` by default), its value taken as the namespace (for a
   gateway in front of the server that authenticates users and sets it);
3. else the engine config's ``namespace``: one shared cache, the default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvrag.errors import InvalidRequestError

__all__ = ["ServerSettings", "TenantMap", "AuthenticationError"]


class AuthenticationError(InvalidRequestError):
    """A request's API key is missing or unknown (HTTP 401)."""


@dataclass(frozen=True, slots=True)
class TenantMap:
    """How a request's headers name its tenant (see the module docstring).

    Attributes:
        api_keys: API key -> namespace. Non-empty: every request needs one of these keys.
        header: the header whose value is the namespace when there is no API-key map; ``None``
            turns it off (every request then uses the default namespace).
    """

    api_keys: Mapping[str, str] = field(default_factory=dict)
    header: str | None = "X-Kvrag-Tenant"

    def __post_init__(self) -> None:
        for key, namespace in self.api_keys.items():
            if not isinstance(key, str) or not key or not isinstance(namespace, str) or not namespace:
                raise InvalidRequestError("api_keys maps non-empty key strings to non-empty namespace strings")

    def namespace(self, headers: Mapping[str, str]) -> str | None:
        """The tenant of a request with these (case-insensitive) headers; ``None`` = the default namespace.

        Raises:
            AuthenticationError: the server has API keys and the request brings none of them.
        """
        if self.api_keys:
            scheme, _, key = (headers.get("authorization") or "").partition(" ")
            namespace = self.api_keys.get(key.strip()) if scheme.lower() == "bearer" else None
            if namespace is None:
                raise AuthenticationError("missing or unknown API key (send it as Authorization: Bearer KEY)")
            return namespace
        if self.header is not None:
            return headers.get(self.header.lower()) or None
        return None


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Settings of ``kvrag serve`` beyond the engine's own config.

    Attributes:
        model_name: the model's name in responses and ``/v1/models`` (default: the engine's).
            Requests may name it or ``default``; any other name is answered with 404.
        tenants: how requests find their tenant.
        retry_after_s: ``Retry-After`` sent with an overload answer (503).
    """

    model_name: str | None = None
    tenants: TenantMap = field(default_factory=TenantMap)
    retry_after_s: int = 1
