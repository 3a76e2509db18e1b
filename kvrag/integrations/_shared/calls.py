"""What a kvrag LLM accepts, in both integrations: fields, per-call arguments, the engine it uses.

One table, :data:`CALL_ARGUMENTS`, names every per-call argument and the engine keyword it
becomes; :class:`GenerationFields` holds the LLM fields both integrations share and turns a call
into an :class:`~kvrag.integrations._shared.results.EngineCall`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

from pydantic import ConfigDict, Field, PrivateAttr, SecretStr, field_validator

import kvrag.engine  # get_engine is looked up at call time: swappable, e.g. to prove construction loads nothing
from kvrag.calls import EngineCall
from kvrag.calls.fields import ReuseFields
from kvrag.config import FLAT_FIELDS, MODES, QUALITIES, EngineConfig, SamplingParams, check_field_names, check_ratio
from kvrag.engine import Engine
from kvrag.engine.options import OPTION_DOCS, REUSE_OPTIONS, SAMPLING_OPTIONS
from kvrag.errors import InvalidRequestError
from kvrag.integrations._shared.remote import Prompt, ServerDocuments

__all__ = [
    "CALL_ARGUMENTS",
    "GenerationFields",
    "Mode",
    "call_options",
    "check_engine_choice",
    "check_target",
    "engine_of",
    "registrar_of",
]

# Subscripting Literal with the tuple itself keeps kvrag.config the one list of modes. Selections
# are a plain string: the engine's registry is their one list, checked when a call runs (a server
# may have selections this process does not).
Mode = Literal[MODES]  # type: ignore[valid-type]
Quality = Literal[QUALITIES]  # type: ignore[valid-type]

#: Per-call keyword arguments (``llm.invoke(x, temperature=0.2)``, ``llm.complete(x, mode="full")``)
#: and the engine name each one becomes: a :class:`~kvrag.RequestOptions` field, or ``model``, which
#: picks the engine. Aliases map to the same name. LLM fields with these names are the defaults.
CALL_ARGUMENTS: Mapping[str, str] = MappingProxyType(
    {
        **{name: name for name in (*SAMPLING_OPTIONS, *REUSE_OPTIONS)},
        "max_tokens": "max_new_tokens",
        "model": "model",
    }
)

# Request settings are LLM fields and per-call arguments; in ``engine_config`` they would create
# a separate engine (another copy of the model) per value. ``sampling`` holds the defaults of
# ``max_new_tokens``, ``temperature``, ... : those are LLM fields too.
_CONFIG_FIELDS = set(FLAT_FIELDS)
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
_PER_CALL_CONFIG = ((_CONFIG_FIELDS | _SAMPLING_FIELDS) & set(CALL_ARGUMENTS.values())) | {"sampling"}
_ENGINE_CONFIG = _CONFIG_FIELDS - _PER_CALL_CONFIG


def call_options(defaults: Mapping[str, Any], kwargs: Mapping[str, Any], *, owner: str) -> dict[str, Any]:
    """One call's engine arguments: ``defaults`` overridden by the call's own arguments.

    Args:
        defaults: values by engine name (an LLM's fields); ``None`` = the engine's default.
        kwargs: the call's keyword arguments, by the names of :data:`CALL_ARGUMENTS`; ``None``
            means not given (the default stays).
        owner: the class named in errors.

    Returns:
        Every engine name of :data:`CALL_ARGUMENTS` (``model`` included) with its value.

    Raises:
        InvalidRequestError: an argument outside :data:`CALL_ARGUMENTS`, or two aliases of one
            argument given different values.
    """
    unknown = sorted(set(kwargs) - CALL_ARGUMENTS.keys())
    if unknown:
        raise InvalidRequestError(
            f"unknown argument(s) {', '.join(unknown)}; {owner} accepts {', '.join(sorted(CALL_ARGUMENTS))}"
        )
    options = {name: defaults.get(name) for name in CALL_ARGUMENTS.values()}
    given: dict[str, str] = {}
    for name, value in kwargs.items():
        if value is None:
            continue
        target = CALL_ARGUMENTS[name]
        if target in given and options[target] != value:
            raise InvalidRequestError(f"{given[target]} and {name} are one argument; give one of them")
        given[target] = name
        options[target] = value
    return options


def check_engine_choice(
    engine: Any, model: str | None, engine_config: Mapping[str, Any] | None, base_url: str | None = None
) -> None:
    """An LLM takes an engine, or the model and config of a shared one, or a server's ``base_url``: one of them."""
    if base_url is not None and (engine is not None or engine_config):
        raise InvalidRequestError("give either base_url= (a kvrag server) or engine=/engine_config=, not both")
    if engine is None:
        return
    if not isinstance(engine, Engine):
        raise InvalidRequestError(f"engine must be a kvrag Engine, got {type(engine).__name__}")
    if model is not None or engine_config:
        raise InvalidRequestError("give either engine= or model=/engine_config=, not both")


def check_target(target: Any) -> None:
    """Raise unless :func:`engine_of` can resolve ``target`` (checked without loading an engine)."""
    if target is not None and not isinstance(target, Engine) and not callable(getattr(target, "get_engine", None)):
        raise InvalidRequestError(f"expected a kvrag LLM, a kvrag Engine or None, got {type(target).__name__}")


def engine_of(target: Any) -> Engine:
    """The engine behind a registration target: an LLM's, an engine itself, or (``None``) the shared default."""
    check_target(target)
    if target is None:
        return kvrag.engine.get_engine()
    if isinstance(target, Engine):
        return target
    return target.get_engine()


def registrar_of(target: Any) -> Engine | ServerDocuments:
    """Where documents recorded for a target go (``register``, ``warm``): :func:`engine_of`, except
    that an LLM with ``base_url`` keeps them and sends them with its requests."""
    check_target(target)
    registrar = getattr(target, "registrar", None)
    return registrar() if callable(registrar) else engine_of(target)


class GenerationFields(ReuseFields):
    """The fields of a kvrag LLM, the same in both integrations, and how a call uses them.

    The engine is not loaded when the LLM is constructed: the first call takes it from the
    process-wide registry (:func:`kvrag.engine.get_engine`), keyed by model and ``engine_config``,
    so every LLM, retriever and node postprocessor with the same settings shares one engine (and
    one chunk registry and KV cache). An LLM given an ``engine`` uses that one instead.

    With ``base_url`` the LLM loads no engine: it calls a ``kvrag serve`` server (``model`` then
    names the served model, ``None`` = whatever it serves), sends the documents recorded for it
    with the requests whose prompt holds them, and reports the server engine's figures under the
    same metadata keys.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    model: str | None = Field(
        default=None,
        description="None = the bundled SmolLM2-135M-Instruct; else a local HF model directory or .gguf file "
        "(with base_url: the served model's name, None = the server's).",
    )
    base_url: str | None = Field(
        default=None,
        description="A kvrag server (`kvrag serve`) to call instead of loading an engine, e.g. http://127.0.0.1:8000.",
    )
    api_key: SecretStr | None = Field(default=None, description="The server's API key (with base_url).")
    tenant: str | None = Field(
        default=None,
        description="Sent in the server's tenant header (with base_url): the cache namespace. The server takes it "
        "only when started with --trust-tenant-header (behind a gateway); with API keys, the key names the tenant.",
    )
    engine_config: dict[str, Any] = Field(
        default_factory=dict,
        description="EngineConfig fields of the shared engine (dtype, device, memory_budget_bytes, ...).",
    )
    mode: Mode | None = Field(default=None, description=OPTION_DOCS["mode"])  # a choice in the LLM's schema
    quality: Quality | None = Field(default=None, description=OPTION_DOCS["quality"])
    temperature: float | None = Field(default=None, description=OPTION_DOCS["temperature"])
    top_p: float | None = Field(default=None, description=OPTION_DOCS["top_p"])
    seed: int | None = Field(default=None, description=OPTION_DOCS["seed"])
    stop: list[str] | None = Field(default=None, description=OPTION_DOCS["stop"])

    _server: ServerDocuments | None = PrivateAttr(default=None)

    @field_validator("engine_config")
    @classmethod
    def _check_engine_config(cls, value: dict[str, Any]) -> dict[str, Any]:
        per_call = sorted(set(value) & _PER_CALL_CONFIG)
        if per_call:
            raise ValueError(f"pass {', '.join(per_call)} as LLM fields or per-call arguments, not in engine_config")
        unknown = sorted(set(value) - _ENGINE_CONFIG)
        if unknown:
            try:
                check_field_names(unknown)  # a former field says where it went
            except TypeError as e:
                raise ValueError(f"engine_config: {e}") from None
        EngineConfig(**value)  # validates values (cheap: no model is loaded)
        return value

    @field_validator("recompute_ratio")
    @classmethod
    def _check_ratio(cls, value: float | str | None) -> float | str | None:
        return None if value is None else check_ratio(value)

    def _given_engine(self) -> Engine | None:
        """The engine passed at construction, if any (each integration keeps it its own way)."""
        raise NotImplementedError

    def server(self) -> ServerDocuments | None:
        """With ``base_url``: the server this LLM calls and the documents recorded for it; else ``None``."""
        if self.base_url is None:
            return None
        if self._server is None:
            from kvrag.client import Client  # httpx: needed only with base_url

            key = self.api_key.get_secret_value() if self.api_key is not None else None
            self._server = ServerDocuments(Client(self.base_url, api_key=key, tenant=self.tenant))
        return self._server

    def registrar(self) -> Engine | ServerDocuments:
        """Where documents recorded for this LLM go: its engine, or (``base_url``) its requests."""
        return self.server() or self.get_engine()

    def get_engine(self, model: str | None = None) -> Engine:
        """The engine serving this LLM: the one given, else the shared one; ``model`` (per call) overrides."""
        if self.base_url is not None:
            raise InvalidRequestError(
                f"{type(self).__name__} calls the kvrag server at {self.base_url}; it has no engine of its own"
            )
        given = self._given_engine()
        if given is not None and model is None:
            return given
        return kvrag.engine.get_engine(model if model is not None else self.model, **self.engine_config)

    def call_defaults(self) -> dict[str, Any]:
        """This LLM's fields named in :data:`CALL_ARGUMENTS`, by engine name: a call's defaults."""
        fields = type(self).model_fields
        return {target: getattr(self, name) for name, target in CALL_ARGUMENTS.items() if name in fields}

    def start_call(self, prompt: Prompt, kwargs: Mapping[str, Any], defaults: Mapping[str, Any]) -> EngineCall:
        """Validate a call and start it on the engine or the server (checked before this returns).

        Args:
            prompt: what to send: chat messages or a finished prompt string.
            kwargs: the call's arguments (see :func:`call_options`).
            defaults: the call's defaults by engine name, usually :meth:`call_defaults`.
        """
        options = call_options(defaults, kwargs, owner=type(self).__name__)
        model = options.pop("model")
        if model is None:
            model = self.model
        server = self.server()
        if server is not None:
            stream = server.stream(prompt, model=model, options=options)
            name = model if model not in (None, "default") else server.model_name()
        else:
            engine = self.get_engine(model)
            stream = engine.stream(prompt=prompt.render(engine), **options)
            name = model if model is not None else engine.model_name
        return EngineCall(stream, model_name=name, conversation_id=options["conversation_id"])

    def end_conversation(self, conversation_id: str) -> bool:
        """Forget a conversation's kept KV, in the engine or on the server; False if it was not live."""
        server = self.server()
        if server is not None:
            return server.client.end_conversation(conversation_id)
        return self.get_engine().end_conversation(conversation_id)
