"""What a request's output must look like (:class:`Constraint`): a JSON schema, any JSON object, a regex or a
grammar, enforced token by token while it decodes (the sampler masks every token the constraint forbids).

A constraint is a value: made and checked here (without torch or the grammar library), compiled by the
engine for its tokenizer when a request carries it. Pass it as ``sampling=SamplingParams(constraint=...)``
or as the request option ``constraint=``::

    engine.generate(chunks=docs, suffix=question, constraint=Constraint.json_schema(Answer.model_json_schema()))
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvrag.errors import InvalidRequestError

__all__ = ["Constraint", "CONSTRAINT_KINDS"]

#: The kinds of :class:`Constraint`, by name.
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "lark")


@dataclass(frozen=True, slots=True)
class Constraint:
    """A request's output constraint. Make one with :meth:`json_schema`, :meth:`json_object`, :meth:`regex`
    or :meth:`grammar` (each checks its argument); two equal constraints compile once.

    Attributes:
        kind: one of :data:`CONSTRAINT_KINDS`.
        spec: the schema as JSON text (``json_schema``), the pattern (``regex``), the grammar (``lark``:
            llguidance's Lark dialect, where a rule may be ``%json { ...schema... }``); ``""`` for ``json_object``.
    """

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidRequestError(
                f"constraint kind must be one of {', '.join(map(repr, CONSTRAINT_KINDS))}, got {self.kind!r}"
            )
        if not isinstance(self.spec, str):
            raise InvalidRequestError(
                f"a {self.kind} constraint's spec must be a string, got {type(self.spec).__name__}"
            )
        if self.kind == "json_object":
            if self.spec:
                raise InvalidRequestError("a json_object constraint takes no spec")
        elif not self.spec:
            raise InvalidRequestError(f"a {self.kind} constraint needs a non-empty spec")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except ValueError as e:
                raise InvalidRequestError(f"a json_schema constraint's spec is not JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError(f"a JSON schema is an object (or true/false), got {type(schema).__name__}")

    @classmethod
    def json_schema(cls, schema: dict | str) -> Constraint:
        """Output that is one JSON value valid against ``schema`` (a dict, or its JSON text)."""
        if isinstance(schema, dict):
            try:
                schema = json.dumps(schema, sort_keys=True)
            except (TypeError, ValueError) as e:
                raise InvalidRequestError(f"the JSON schema does not serialise to JSON: {e}") from None
        elif not isinstance(schema, str):
            raise InvalidRequestError(f"a JSON schema is a dict or its JSON text, got {type(schema).__name__}")
        return cls("json_schema", schema)

    @classmethod
    def json_object(cls) -> Constraint:
        """Output that is one JSON object, any keys (OpenAI's ``response_format={"type": "json_object"}``)."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """Output that matches ``pattern`` as a whole."""
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, lark: str) -> Constraint:
        """Output in the language of a Lark grammar (llguidance's dialect: ``start`` is the first rule)."""
        return cls("lark", lark)
