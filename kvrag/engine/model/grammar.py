"""Constrained decoding: a request's :class:`~kvrag.config.Constraint` compiled for the model's tokenizer
by llguidance, and one matcher per sequence that masks its logits before each token is sampled.

:class:`Grammars` (one per engine) compiles each distinct constraint once, on the caller's thread when the
request is submitted (a bad spec is one :class:`~kvrag.errors.InvalidRequestError` before any work), and
keeps the compiled matchers in a bounded LRU. :meth:`Grammars.matcher` hands a sequence its own copy
(:class:`GrammarMatcher`, a few microseconds): it masks the logits of the next token
(:meth:`GrammarMatcher.mask`), advances on the token sampled (:meth:`GrammarMatcher.advance`), tells how
many prompt-lookup drafts the grammar allows (:meth:`GrammarMatcher.allowed`) and when the output is
complete (:attr:`GrammarMatcher.stopped`). End-of-sequence tokens are allowed only where the grammar
accepts. llguidance computes a mask in Rust (microseconds: its lexer walks the tokenizer's trie); the
mask is applied here as one write over the vocabulary (numpy's, on a CPU).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np
import torch

from kvrag.config import Constraint, SamplingParams
from kvrag.engine.model.sampling import sample
from kvrag.errors import InvalidRequestError

__all__ = ["Grammars", "GrammarMatcher", "JSON_LAYOUT", "MAX_COMPILED", "sample_next"]

#: compiled constraints an engine keeps (least recently used dropped first)
MAX_COMPILED = 64


#: JSON's whitespace: the model's own layout (compact, json.dumps's, indented), at most 20 spaces or newlines
#: in a gap. Unbounded, a small model can spend its token budget on whitespace; forced compact (no spaces),
#: Qwen2.5-0.5B wrote worse answers and ran more strings to the limit (docs/constrained.md: the measurement)
JSON_LAYOUT = {"whitespace_flexible": True, "whitespace_pattern": r"[\n ]{0,20}"}


def _grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (its errors found when a matcher is built from it)."""
    from llguidance import LLMatcher

    if constraint.kind == "json_schema":
        spec = constraint.spec.strip()
        if spec == "false":
            raise InvalidRequestError("the json_schema constraint is `false`: no output is valid")
        try:  # `true` (any JSON value) is the schema {}: the layout applies to an object schema
            return LLMatcher.grammar_from_json_schema("{}" if spec == "true" else spec, defaults=JSON_LAYOUT)
        except ValueError as e:
            raise InvalidRequestError(f"the json_schema constraint is not a JSON schema: {e}") from None
    if constraint.kind == "json_object":
        return LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=JSON_LAYOUT)
    if constraint.kind == "regex":
        return LLMatcher.grammar_from_regex(constraint.spec)
    return LLMatcher.grammar_from_lark(constraint.spec)


class Grammars:
    """Constraints compiled for one tokenizer (llguidance), each distinct one once.

    Args:
        tokenizer: the model's Hugging Face (fast) tokenizer.
        eos_ids: the tokens that end a sequence (allowed only where the grammar accepts).
        vocab_size: the model's logits width (may exceed the tokenizer's: the extra ids are never allowed; a
            tokenizer larger than it, a small test model's, is read whole and its extra ids never sampled).
        max_compiled: compiled constraints kept (LRU).
    """

    def __init__(self, tokenizer, eos_ids: Iterable[int], vocab_size: int, max_compiled: int = MAX_COMPILED) -> None:
        self.hf_tokenizer, self.eos_ids = tokenizer, frozenset(int(t) for t in eos_ids)
        self.vocab_size, self.max_compiled = vocab_size, max_compiled
        self.n_vocab = vocab_size  # the tokenizer's size where larger, once it is read
        self._ll_tokenizer = None  # built at the first constraint (~0.4 s for 49K tokens, ~1.5 s for 151K)
        self._compiled: OrderedDict[Constraint, object] = OrderedDict()
        self._lock = threading.Lock()

    def _tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance.hf

            if self.hf_tokenizer is None or not getattr(self.hf_tokenizer, "is_fast", False):
                raise InvalidRequestError("constrained decoding needs the model's fast (Rust) tokenizer")
            eos = sorted(self.eos_ids) or None
            self.n_vocab = max(self.vocab_size, len(self.hf_tokenizer))  # llguidance reads every token
            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.n_vocab, eos_token=eos
                )
            except (ValueError, RuntimeError) as e:  # a tokenizer llguidance cannot read (refused, not guessed)
                raise InvalidRequestError(f"constrained decoding cannot use this model's tokenizer: {e}") from None
        return self._ll_tokenizer

    def compiled(self, constraint: Constraint):
        """The constraint's compiled matcher (never advanced: a sequence gets a copy), compiled once.
        Raises :class:`~kvrag.errors.InvalidRequestError` naming what is wrong with a bad spec."""
        if not isinstance(constraint, Constraint):
            raise InvalidRequestError(f"a constraint must be a kvrag.Constraint, got {type(constraint).__name__}")
        with self._lock:
            hit = self._compiled.get(constraint)
            if hit is not None:
                self._compiled.move_to_end(constraint)
                return hit
            tokenizer = self._tokenizer()
        from llguidance import LLMatcher

        # compiled outside the lock (llguidance drops the GIL): another constraint need not wait
        matcher = LLMatcher(tokenizer, _grammar_text(constraint), log_level=0)
        if matcher.is_error():
            error = matcher.get_error().strip()
            raise InvalidRequestError(f"the {constraint.kind} constraint does not compile: {error}")
        with self._lock:
            self._compiled[constraint] = matcher
            self._compiled.move_to_end(constraint)
            while len(self._compiled) > self.max_compiled:
                self._compiled.popitem(last=False)
        return matcher

    def check(self, constraint: Constraint) -> None:
        """Compile ``constraint`` now (a request's submission, on the caller's thread): a bad spec raises
        :class:`~kvrag.errors.InvalidRequestError` before any work, and the engine thread finds it compiled."""
        self.compiled(constraint)

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A new sequence's matcher, at the grammar's start."""
        return GrammarMatcher(self.compiled(constraint).deep_copy(), self.n_vocab, self.eos_ids)


class GrammarMatcher:
    """One sequence's place in its grammar: it has consumed every token sampled for the sequence.

    Args:
        matcher: an llguidance ``LLMatcher`` of its own.
        vocab_size: the grammar's vocabulary (the logits' width, or the tokenizer's where larger).
        eos_ids: the tokens that end the sequence.
    """

    def __init__(self, matcher, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self._m, self.vocab_size, self.eos_ids = matcher, vocab_size, eos_ids
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)  # the mask: bit i of word i // 32

    def forbidden(self) -> torch.Tensor:
        """[V] bool: True where the grammar forbids the next token."""
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        # unpacking the inverted words gives 1 where a token is forbidden, with no second pass
        bits = np.unpackbits(~self._bits.view(np.uint8), bitorder="little")[: self.vocab_size]
        return torch.from_numpy(bits.view(np.bool_))

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """Set the logits [V] of every token the grammar forbids next to -inf (in place); returns them."""
        forbidden = self.forbidden()
        n = min(logits.shape[-1], self.vocab_size)
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
            # numpy writes on this thread alone: torch's masked_fill_ over 151K logits splits across the
            # intra-op threads, and on a busy CPU their barrier measured ~12 ms where this takes ~40 us
            np.copyto(logits.numpy()[:n], -np.inf, where=forbidden.numpy()[:n])
            return logits
        logits[..., :n].masked_fill_(forbidden[:n].to(logits.device, non_blocking=True), float("-inf"))
        return logits

    def advance(self, token: int) -> None:
        """Consume the token sampled (one the mask allowed)."""
        if not self._m.consume_token(int(token)):
            raise RuntimeError(f"kvrag: the grammar refused token {token} it had allowed: {self._m.get_error()}")

    def allowed(self, tokens: list[int]) -> int:
        """How many of ``tokens`` (drafts of the next tokens) the grammar allows in a row (nothing consumed)."""
        return self._m.validate_tokens(tokens) if tokens else 0

    @property
    def stopped(self) -> bool:
        """The output is complete: no token but the end of sequence may follow."""
        return self._m.is_stopped()


def sample_next(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None, grammar: GrammarMatcher | None
) -> int:
    """The next token from logits [V]: masked by ``grammar`` first (which then consumes it), if any."""
    if grammar is None:
        return sample(logits, sampling.temperature, sampling.top_p, generator)
    token = sample(grammar.mask(logits), sampling.temperature, sampling.top_p, generator)
    grammar.advance(token)
    return token
