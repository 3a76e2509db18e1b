"""The one integration layer under the LangChain and LlamaIndex drop-ins.

Both are thin translators over this package, which imports neither framework:

- :mod:`.calls`: the LLM fields, the per-call argument table (:data:`CALL_ARGUMENTS`), how a call
  finds its engine (the one given, else the shared one of model + ``engine_config``).
- :mod:`kvrag.calls` (shared with the server): one engine request as an iterator
  (:class:`EngineCall`) and its figures (:func:`call_metadata`, :func:`usage`), the same keys in both
  frameworks; the async bridge (:func:`open_in_thread`); chat roles (:func:`template_role`).
- :mod:`.remote`: what a call sends (:class:`Prompt`), and the ``kvrag serve`` server an LLM with
  ``base_url=`` calls instead of an engine (:class:`ServerDocuments`).
"""

from kvrag.calls import METADATA_KEYS, EngineCall, call_metadata, open_in_thread, template_role, usage
from kvrag.integrations._shared.calls import (
    CALL_ARGUMENTS,
    GenerationFields,
    Mode,
    call_options,
    check_engine_choice,
    check_target,
    engine_of,
    registrar_of,
)
from kvrag.integrations._shared.remote import Prompt, ServerDocuments

__all__ = [
    "CALL_ARGUMENTS",
    "METADATA_KEYS",
    "EngineCall",
    "GenerationFields",
    "Mode",
    "Prompt",
    "ServerDocuments",
    "call_metadata",
    "call_options",
    "check_engine_choice",
    "check_target",
    "engine_of",
    "open_in_thread",
    "registrar_of",
    "template_role",
    "usage",
]
