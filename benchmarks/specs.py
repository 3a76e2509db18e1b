"""Method specs: ``base[@arg][+field=value]...``, parsed and checked before anything runs.

- ``base``: a registered method (``full``, ``probe``, ``hkvd``, ``epic``, ``blend``, ...).
- ``@arg``: the method's argument; for the blend methods the recompute ratio (``probe@0.15``).
- ``+field=value``: an :class:`~kvrag.EngineConfig` override for this method alone, for ablations
  (``epic@0.15+chunk_context=sink``), or a parameter of the method's selection strategy
  (``probe@0.15+probe_layer=12``, ``hkvd@0.15+filter_schedule=[3.0,2.0]``: any parameter a
  registered selection takes, written bare, goes to ``selection_params``, and the method's
  selection becomes the engine's). Values are JSON where they parse (``12``, ``0.5``, ``true``,
  ``[2.0,1.5]``), else plain strings (``sink``). A method with overrides runs on an engine of its
  own built with them (same weights). ``full`` takes only ``dtype`` (``full+dtype=float32``: a float32
  reference beside a run in another dtype, on the model loaded in that dtype).
- ``+order=frequency``: the chunk order of the method's requests (``Engine.generate``'s
  ``chunk_order``: ``retrieval``, the default, or CRAFT's ``frequency``); not an engine setting, so
  any method takes it, ``full`` too (``full+order=frequency``: the order-only drift's reference).

A comma separates methods in a list; commas inside brackets belong to a value
(``full,hkvd@0.15+filter_schedule=[3.0,2.0]``). The name a method's results are filed under is
its spec as written.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrag.errors import InvalidRequestError

__all__ = [
    "MethodSpec",
    "parse_spec",
    "split_specs",
    "config_overrides",
    "check_selection_params",
    "command_line_overrides",
    "FIXED_FIELDS",
    "STORE_FIELDS",
]

#: Fields no method may override: every method of a run runs the same model on the same device
#: (``dtype`` is not among them: ``full+dtype=float32`` is a reference, see :mod:`benchmarks.methods`).
FIXED_FIELDS = frozenset({"model", "device", "cache_dir", "num_threads"})
#: Fields of the store itself: an override of one needs a store of the method's own.
STORE_FIELDS = frozenset(
    {
        "memory_budget_bytes",
        "disk_tier",
        "disk_budget_bytes",
        "disk_dtype",
        "eviction_policy",
        "prefetch",
        "kv_codec",
        "remote_url",
    }
)


@dataclass(frozen=True, slots=True)
class MethodSpec:
    """A parsed method name.

    Attributes:
        name: the spec as written (results are filed under it).
        base: the registered method.
        arg: the text after ``@`` (each method parses its own), or None.
        overrides: ``(field, value)`` pairs of EngineConfig overrides, in the order given.
        order: the chunk order its requests ask for (``+order=...``), or None (the engine's: retrieval).
    """

    name: str
    base: str
    arg: str | None = None
    overrides: tuple[tuple[str, object], ...] = ()
    order: str | None = None


def _strategy_parameter(pair: str) -> str:
    """``probe_layer=12`` -> ``selection_params.probe_layer=12`` when ``probe_layer`` is no EngineConfig
    field but a parameter of a registered selection; other pairs as they are."""
    from kvrag.config import FLAT_FIELDS
    from kvrag.engine.reuse.selection import params_class, registered_selections

    key = pair.partition("=")[0].strip()
    if "=" not in pair or "." in key or key in FLAT_FIELDS:
        return pair
    taken = {n for s in registered_selections() for n in params_class(s).names()}
    return f"selection_params.{pair.strip()}" if key in taken else pair


def check_selection_params(overrides: dict) -> None:
    """Check the selection and ``selection_params`` of a config built with ``overrides`` against the
    selection registry (what :class:`~kvrag.EngineConfig` alone cannot: the registry needs torch)."""
    from kvrag.config import EngineConfig
    from kvrag.engine.reuse.selection import configured_params

    configured_params(EngineConfig().replace(**overrides))


def config_overrides(pairs: list[str], *, what: str = "--config", check_selection: bool = True) -> dict:
    """``["field=value", ...]`` -> ``{field: value}`` (:func:`kvrag.config.parse_overrides`), with the
    values checked by building an :class:`~kvrag.EngineConfig` from them. A bare parameter of a
    selection strategy (``probe_layer=12``) is ``selection_params.probe_layer=12``.

    Args:
        check_selection: also check the selection's parameters against the selection the overrides
            leave configured (off where the caller knows the selection better: a method spec).

    Raises:
        InvalidRequestError: a pair without ``=``, a field EngineConfig does not have, or a value
            it rejects (named, with ``what`` saying where it was written).
    """
    from kvrag.config import EngineConfig, parse_overrides

    try:
        out = parse_overrides(_strategy_parameter(pair) for pair in pairs)
        EngineConfig().replace(**out)
        if check_selection:
            check_selection_params(out)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{what}: {exc}") from None
    return out


def command_line_overrides(pairs: list[str], prog: str = "python -m benchmarks") -> dict:
    """:func:`config_overrides` of a command's ``--config`` flags: a bad one ends the command with
    its message (``SystemExit``), before any model loads."""
    try:
        return config_overrides(pairs)
    except InvalidRequestError as exc:
        raise SystemExit(f"{prog}: {exc}") from None


def parse_spec(text: str, known: set[str] | dict) -> MethodSpec:
    """One method spec (see the module docstring); ``known`` are the registered base names."""
    name = text.strip()
    head, *pairs = name.split("+")
    base, sep, arg = head.strip().partition("@")
    if base not in known:
        raise InvalidRequestError(
            f"unknown method {name!r}; known: {', '.join(known)} (as NAME, NAME@RATIO, NAME@RATIO+FIELD=VALUE)"
        )
    if sep and not arg.strip():
        raise InvalidRequestError(f"method {name!r}: nothing after '@'")
    order = None
    for pair in [p for p in pairs if p.partition("=")[0].strip() == "order"]:
        from kvrag.engine.reuse.access import check_chunk_order

        try:
            order = check_chunk_order(pair.partition("=")[2].strip())
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"method {name!r}: {exc}") from None
        pairs.remove(pair)
    overrides = config_overrides(pairs, what=f"method {name!r}", check_selection=False) if pairs else {}
    fixed = sorted(FIXED_FIELDS & overrides.keys())
    if fixed:
        raise InvalidRequestError(
            f"method {name!r}: {', '.join(fixed)} cannot differ between methods (same model, same device); "
            "set it for the whole run with --config"
        )
    if overrides.get("dtype") == "auto":
        raise InvalidRequestError(
            f"method {name!r}: name a dtype (float32, bfloat16, float16); the run's is --config dtype"
        )
    return MethodSpec(name, base, arg.strip() if sep else None, tuple(overrides.items()), order)


def split_specs(text: str) -> list[str]:
    """A comma-separated list of specs; commas inside ``[...]`` stay in their value."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return [s.strip() for s in out if s.strip()]
