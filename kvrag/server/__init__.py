"""``kvrag serve``: an OpenAI-compatible HTTP server over the embedded engine.

Any OpenAI client (``openai``, LangChain's ``ChatOpenAI``, LlamaIndex's ``OpenAILike``, curl) talks
to it; chunk reuse needs the chunk boundaries, which come with a request (the ``documents``
field) or once for all requests (``POST /v1/documents``). kvrag's own client is
:mod:`kvrag.client`. Needs ``pip install "kvrag[serve]"``.

- :func:`create_app`: the ASGI app over an engine (:mod:`.app`).
- :class:`ServerSettings`, :class:`TenantMap`, :class:`Limits`: served name, tenants and what one
  request may bring (:mod:`.settings`; the trust model: ``docs/server.md``).
- ``kvrag serve``: the command line (:mod:`.cli`).
"""

from kvrag.server.settings import Limits, ServerSettings, TenantMap

__all__ = ["Limits", "ServerSettings", "TenantMap", "create_app"]


def __getattr__(name: str):
    # FastAPI loads when an app is built, so that `kvrag serve` can tell a missing extra apart
    if name == "create_app":
        from kvrag.server.app import create_app

        return create_app
    raise AttributeError(f"module 'kvrag.server' has no attribute {name!r}")
