"""A request validated once, on the caller's thread: one clear error per bad input.

:class:`Requests` turns a call's prompt and :class:`~kvrag.engine.options.RequestOptions` into a
:class:`Request`: the prompt split into text and chunk segments and tokenised, the conversation's
earlier documents dropped, and the recompute :class:`~kvrag.engine.reuse.budget.Budget` resolved
(:func:`resolve_budget`) — the one place ``recompute_ratio``, ``quality``, the threshold and the
other-context rule become a value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvrag.config import AUTO, EngineConfig, SamplingParams
from kvrag.engine.model.grammar import Grammars
from kvrag.engine.options import SAMPLING_OPTIONS, RequestOptions
from kvrag.engine.reuse.access import AccessTable, check_chunk_order
from kvrag.engine.reuse.budget import Budget, OtherContextRule
from kvrag.engine.reuse.conversations import ConversationKey, Conversations, check_conversation_id, check_id
from kvrag.engine.reuse.documents import DocumentFinder
from kvrag.engine.reuse.gate import GateResult
from kvrag.engine.reuse.segments import PromptTokenizer, Segment
from kvrag.engine.reuse.selection import auto_kind, check_selection, configured_params
from kvrag.engine.store.policy import check_policy
from kvrag.errors import ContextLengthError, InvalidRequestError

__all__ = [
    "Request",
    "Requests",
    "resolve_budget",
    "describe_blend",
    "check_engine_config",
    "check_text",
    "check_chunks",
    "check_namespace",
    "signature",
    "WHOLE_TEXT_MARGIN",
]

#: A prompt string whose whole-text token count reaches this many context windows is refused before
#: it is split (:meth:`Requests.check_chars`).
WHOLE_TEXT_MARGIN = 2


@dataclass(slots=True, kw_only=True)
class Request:
    """A validated request, ready to plan."""

    segments: list[Segment]
    ids: torch.Tensor  # [N]
    mode: str
    budget: Budget  # what a blend recomputes (resolved once: resolve_budget)
    sampling: SamplingParams  # resolved: no None fields
    namespace: str = "default"  # the tenant: cache entries and conversations of others are never seen
    conversation: ConversationKey | None = None  # the conversation's key: (namespace, its id)
    deduplicated: int = 0
    conversation_spans: list | None = None
    follow: Any = None  # the kept turn of the conversation its prompt continues (reuse.conversations.Continuation)
    priced: bool = True  # the cost model may lower its path (off for a measurement of its mode)
    # speculation (serving.speculation): a speculative prefill's request (its lookups are looks, not
    # uses: access counters skip it), and the speculation a final request adopts
    speculative: bool = False
    adopt: Any = None

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])


def signature(req: Request) -> tuple:
    """What a request must share with a prompt speculation to adopt it: the same prefill and sampling."""
    return (tuple(req.ids.tolist()), req.mode, req.budget, req.namespace, repr(req.sampling))


def resolve_budget(cfg: EngineConfig, mode: str, options: RequestOptions) -> Budget:
    """The recompute budget of a request: its ``recompute_ratio``, ``selection`` and ``quality`` (each
    defaulting to the config's), the config's ``auto_threshold`` and the other-context rule.

    A fixed ratio is the share of the blended tokens recomputed (``reuse``: none). ``"auto"``
    recomputes what the selection measures is needed, up to ``auto_max_ratio``, where the selection
    measures itself or has a threshold to measure with; else ``quality``'s share. An ``"auto"`` request
    that names no selection, under the default probe, also carries the other-context rule:
    chunk KV computed behind other passages runs ``other_context_selection`` at the quality's
    per-chunk shares (:meth:`~kvrag.engine.reuse.budget.Budget.for_plan`).
    """
    selection = check_selection(cfg.selection if options.selection is None else options.selection)
    ratio = cfg.recompute_ratio if options.recompute_ratio is None else options.recompute_ratio
    if mode == "reuse":
        return Budget(selection, 0.0)
    if ratio != AUTO:
        return Budget(selection, float(ratio))
    own, other = cfg.quality_shares(options.quality)
    rule = None
    if options.selection is None and cfg.selection == "probe" and cfg.other_context_selection is not None:
        rule = OtherContextRule(cfg.other_context_selection, own, other, cfg.other_context_overlap)
    kind, threshold = auto_kind(selection), cfg.auto_threshold
    if kind == "self" or (kind == "threshold" and threshold is not None):
        return Budget(selection, cfg.auto_max_ratio, auto=True, threshold=threshold, other_context=rule)
    return Budget(selection, own, other_context=rule)


class Requests:
    """Validates calls into :class:`Request` values (the caller's thread; no model compute).

    Args:
        config: the engine's settings (defaults of every option).
        tokenizer: the prompt tokenizer (segments tokenised on their own).
        documents: the registered document texts a whole prompt is split at.
        conversations: kept conversations (deduplication, their keys).
        access: CRAFT's chunk-access table (``chunk_order="frequency"``).
        gate: the correctness gate (``blend`` and ``reuse`` refused on a model that failed it).
        grammars: constraints compiled for the tokenizer (a request's constraint is compiled at submission).
        context_window: most tokens a request may hold.
        model_name: named in the gate's refusal.
    """

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: PromptTokenizer,
        documents: DocumentFinder,
        conversations: Conversations,
        access: AccessTable,
        gate: GateResult,
        grammars: Grammars,
        *,
        context_window: int,
        model_name: str,
    ) -> None:
        self.config, self.tokenizer, self.documents = config, tokenizer, documents
        self.conversations, self.access, self.gate, self.grammars = conversations, access, gate, grammars
        self.context_window, self.model_name = context_window, model_name

    def build(
        self,
        chunks: Sequence[str] | None = None,
        prefix: str = "",
        suffix: str = "",
        prompt: str | None = None,
        options: RequestOptions = RequestOptions(),  # noqa: B008 - immutable
        sampling: SamplingParams | None = None,
    ) -> Request:
        """Validate a request and segment its prompt: ``prefix + chunks + suffix`` (``chunks`` in the order
        given) or a whole ``prompt``, with its ``options`` (and ``sampling=`` instead of their sampling fields)."""
        cfg = self.config
        namespace = check_namespace(cfg, options.namespace)
        parts = self.parts(chunks, prefix, suffix, prompt, namespace)
        conversation = check_conversation_id(options.conversation_id)
        if conversation is not None:
            conversation = self.conversation_key(conversation, namespace)
        deduplicated = 0
        if conversation is not None and (cfg.conversation_dedup if options.dedup is None else options.dedup):
            parts, deduplicated = self.conversations.dedup(conversation, parts)
        mode = cfg.mode if options.mode is None else options.mode
        budget = resolve_budget(cfg, mode, options)
        self.gate.require(self.model_name, mode, budget)
        segments, ids = self.tokenizer.segment(parts)
        n = int(ids.shape[0])
        if n == 0:
            raise InvalidRequestError("the prompt is empty: give a prefix, chunks or a suffix with some text")
        if n >= self.context_window:
            raise ContextLengthError(n, self.context_window)
        resolved = _sampling(options, sampling).resolved(cfg.sampling)
        if resolved.constraint is not None:  # a bad spec fails here, before any work; compiled once per spec
            self.grammars.check(resolved.constraint)
        return Request(
            segments=segments,
            ids=ids,
            mode=mode,
            budget=budget,
            sampling=resolved,
            namespace=namespace,
            conversation=conversation,
            deduplicated=deduplicated,
        )

    def parts(self, chunks, prefix, suffix, prompt, namespace: str | None = None) -> list[tuple[str, str]]:
        """The request as ("text" | "chunk", text) parts: from prefix/chunks/suffix, or from a whole
        ``prompt`` split at the documents tenant ``namespace`` (default: the engine's) registered.

        A text far too long for the context window is refused first, before any scan
        (:meth:`check_chars`)."""
        namespace = self.config.namespace if namespace is None else namespace
        chunks = check_chunks(chunks)
        prefix, suffix = check_text("prefix", prefix), check_text("suffix", suffix)
        if prompt is not None:
            if chunks or prefix or suffix:
                raise InvalidRequestError("give either prompt= or prefix/chunks/suffix, not both")
            prompt = check_text("prompt", prompt)
            self.check_chars(len(prompt), prompt)
            return self.documents.split(prompt, namespace)
        self.check_chars(len(prefix) + len(suffix) + sum(map(len, chunks)))
        return [("text", prefix)] + [("chunk", c) for c in chunks] + [("text", suffix)]

    def check_chars(self, chars: int, text: str | None = None) -> None:
        """Refuse a prompt of ``chars`` characters that cannot fit the context window, before it is
        scanned for documents or tokenised part by part.

        O(1) first: it needs at least ``chars / (2 x the longest token's characters)`` tokens (the
        factor 2 covers normalisers that shorten text). Then a long ``text`` (past 4 characters per
        token of the window, where the scan costs more) is tokenised whole, once, in the tokenizer's
        own code: at :data:`WHOLE_TEXT_MARGIN` times the window or more it is refused (its parts,
        tokenised apart, never come that far below the whole text's count)."""
        per_token = self.tokenizer.max_token_chars
        window = self.context_window
        if per_token is not None and chars // (2 * per_token) >= window:
            raise ContextLengthError(chars // (2 * per_token), window, f"at least: {chars} characters")
        if text is not None and chars > 4 * window:
            n = self.tokenizer.count(text)
            if n >= WHOLE_TEXT_MARGIN * window:
                raise ContextLengthError(n, window, "the prompt tokenised whole")

    def order_chunks(self, chunks, prompt: str | None, options: RequestOptions) -> tuple[list[str] | None, list[str]]:
        """``chunks`` in the order ``options.chunk_order`` asks for, and the retrieval to count (none
        without chunks). A later turn of a conversation keeps the given order (its history would
        be recomputed)."""
        order = check_chunk_order("retrieval" if options.chunk_order is None else options.chunk_order)
        if prompt is not None:
            if order != "retrieval":
                raise InvalidRequestError(
                    "chunk_order orders chunks=; a prompt given as one string is used as it is (order the "
                    "documents before rendering it: a retriever wrapper's order='frequency')"
                )
            return chunks, []
        chunks = check_chunks(chunks)
        if order == "retrieval" or len(chunks) < 2:
            return chunks, chunks
        namespace = check_namespace(self.config, options.namespace)
        conversation = check_conversation_id(options.conversation_id)
        if conversation is not None and self.conversation_key(conversation, namespace) in self.conversations:
            return chunks, chunks
        return [chunks[i] for i in self.access.order(namespace, chunks, order)], chunks

    @staticmethod
    def conversation_key(conversation_id: str, namespace: str) -> ConversationKey:
        """A conversation is scoped to its tenant: its key is the tuple ``(namespace, id)``."""
        return (namespace, conversation_id)


def check_engine_config(config: EngineConfig) -> None:
    """What the config cannot check without torch: the selections and their parameters against the
    selection registry, the eviction policy against the store's (one clear error each)."""
    configured_params(config)
    if config.other_context_selection is not None:
        check_selection(config.other_context_selection)
    check_policy(config.eviction_policy)


def describe_blend(cfg: EngineConfig) -> str:
    """What ``blend`` recomputes by default, in a line (:attr:`EngineInfo.blend`)."""
    budget = resolve_budget(cfg, "blend", RequestOptions())
    if cfg.recompute_ratio != AUTO:
        return f"{budget.selection} at {budget.share:.0%} of the cached tokens"
    how = f"measured per request, up to {budget.share:.0%}" if budget.auto else f"{budget.share:.0%} (no threshold set)"
    text = f"{budget.selection}, auto ({cfg.quality}): {how}"
    rule = budget.other_context
    if rule is not None:
        text += (
            f"; KV from another context (overlap < {rule.below:g}): {rule.selection},"
            f" {rule.other:.0%} of each such chunk, {rule.own:.0%} of the others"
        )
    return text


def _sampling(options: RequestOptions, sampling: SamplingParams | None) -> SamplingParams:
    """The request's sampling: ``sampling=`` or the options' sampling fields, not both."""
    if sampling is None:
        return options.sampling()
    if not isinstance(sampling, SamplingParams):
        raise InvalidRequestError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    given = sorted(set(options.given()) & set(SAMPLING_OPTIONS))
    if given:
        raise InvalidRequestError(f"give either sampling= or {', '.join(sorted(given))} as keywords, not both")
    return sampling


def check_text(name: str, value) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidRequestError(f"{name} must be a string, got {type(value).__name__}")
    return value


def check_chunks(chunks) -> list[str]:
    if chunks is None:
        return []
    if isinstance(chunks, (str, bytes)):
        raise InvalidRequestError("chunks must be a list of strings, not a single string")
    if not isinstance(chunks, Sequence) and not hasattr(chunks, "__iter__"):
        raise InvalidRequestError(f"chunks must be a list of strings, got {type(chunks).__name__}")
    out = []
    for i, c in enumerate(chunks):
        if not isinstance(c, str):
            raise InvalidRequestError(f"chunk {i} is {type(c).__name__}; chunks must be strings (document text)")
        out.append(c)
    return out


def check_namespace(cfg: EngineConfig, namespace) -> str:
    """The request's tenant: ``namespace`` (a non-empty string without control characters), or the
    engine's when ``None``."""
    if namespace is None:
        return cfg.namespace
    return check_id("namespace", namespace)
