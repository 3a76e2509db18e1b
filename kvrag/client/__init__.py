"""kvrag's client for ``kvrag serve``: sync (:class:`Client`) and async (:class:`AsyncClient`).

The calls mirror the engine's: results are :class:`~kvrag.engine.Generation` objects with the
server engine's :class:`~kvrag.engine.GenerationStats` (chunk hits, cached and recomputed tokens,
TTFT as the engine measured it), streams yield text pieces and hold ``.generation`` once
exhausted, and bad requests raise the same :mod:`kvrag.errors` classes as the engine::

    from kvrag.client import Client

    with Client("http://127.0.0.1:8000") as client:
        client.warm(passages)                       # once: register and precompute a corpus
        gen = client.chat([{"role": "user", "content": prompt}], max_new_tokens=32)
        print(gen.text, gen.stats.chunk_hits, gen.stats.cached_tokens)
        for piece in (stream := client.stream_chat(messages, documents=retrieved)):
            print(piece, end="")
        print(stream.generation.ttft_s)

``documents=`` names the texts of this request's prompt that are chunks (registered with the
server for this request); texts registered before (:meth:`Client.register`, :meth:`Client.warm`)
need not be sent again. Token ids are not sent over HTTP: ``Generation.token_ids`` is empty.
Needs ``pip install "kvrag[client]"`` (httpx).
"""

from kvrag.client.clients import AsyncClient, AsyncGenerationStream, Client
from kvrag.client.wire import REQUEST_OPTIONS

__all__ = ["Client", "AsyncClient", "AsyncGenerationStream", "REQUEST_OPTIONS"]
