"""What a call into the engine returns, the same for the integrations and the server (neither imports
the other): one call as an iterator and its figures (:mod:`.results`), the async bridge
(:mod:`.threads`), chat roles (:mod:`.roles`). What a call takes is
:class:`kvrag.engine.options.RequestOptions`."""

from kvrag.calls.results import METADATA_KEYS, EngineCall, call_metadata, usage
from kvrag.calls.roles import template_role
from kvrag.calls.threads import open_in_thread

__all__ = ["METADATA_KEYS", "EngineCall", "call_metadata", "usage", "template_role", "open_in_thread"]
