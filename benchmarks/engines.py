"""The engines a run's methods run on: the run's own engine, or one built for a method (same weights).

- :meth:`MethodEngines.shared`: workloads whose methods share one store (a, c). Each method gets
  an engine of its own (with its ``+field=value`` overrides) over the run's engine's store: what
  was warmed there is found, what a method keeps from a request is its own; store settings
  cannot be overridden there.
- :meth:`MethodEngines.own`: workloads where each method keeps its own store (b, r): an engine
  per method, with the workload's store settings and the method's overrides; with a disk tier,
  each in a scratch directory of its own, so methods never share cache entries.
- :meth:`MethodEngines.reference`: a method that reads no store but sets a dtype of its own
  (``full+dtype=float32``, the float32 reference beside a bf16 run): the run's model in that
  dtype, on an engine and a store of its own, in every workload.

An engine in another dtype than the run's cannot share its weights: it gets the model loaded in
that dtype (``load``, which :func:`benchmarks.run.run_bench` gives when it loads the model itself),
or else a converted copy of the run's model (an engine handed in, e.g. a test's).
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import tempfile
from collections.abc import Callable

from benchmarks.methods import Method
from benchmarks.specs import STORE_FIELDS
from kvrag.engine.model.host import on_own_thread
from kvrag.errors import InvalidRequestError

__all__ = ["MethodEngines"]


SCRATCH_PREFIX = "kvrag-bench-"


def scratch_dir(root: str | None = None) -> tempfile.TemporaryDirectory:
    """A temporary directory for the methods' disk tiers, named after this process; the ones that
    processes no longer alive left behind (a run killed by the kernel, or by hand) are removed
    first: their disk tiers are gigabytes each and would fill the disk run after run."""
    root = root or tempfile.gettempdir()
    pattern = re.compile(re.escape(SCRATCH_PREFIX) + r"(\d+)-")
    for entry in os.scandir(root):
        m = pattern.match(entry.name)
        if m and entry.is_dir(follow_symlinks=False) and not _alive(int(m.group(1))):
            shutil.rmtree(entry.path, ignore_errors=True)
    return tempfile.TemporaryDirectory(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=root)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class MethodEngines:
    """Builds (and at :meth:`close` releases) the engines of a run's methods.

    Args:
        base: the run's engine; every engine built here in its dtype shares its weights and tokenizer.
        load: ``load(config, store)`` builds an engine of the run's model in ``config.dtype`` (another
            dtype than the run's); ``None``: convert a copy of the run's model to that dtype.
    """

    def __init__(self, base, load: Callable | None = None) -> None:
        self.base = base
        self.load = load
        self._own: dict[str, object] = {}
        self._shared: dict[str, object] = {}
        self._references: dict[str, object] = {}  # engines of :meth:`reference`
        self._spare: list = []  # engines of :meth:`scratch`
        self._scratch: tempfile.TemporaryDirectory | None = None

    def _build(self, config, store=None):
        from kvrag import Engine

        base = self.base
        if config.dtype != base.config.dtype and self.load is not None:
            return self.load(config, store)

        def build() -> Engine:
            model = base.hf_model  # same weights, same fingerprint: the same chunk keys as the run's engine
            if config.dtype != base.config.dtype:  # other weights, another fingerprint: keys of its own
                import torch

                model = copy.deepcopy(model).to(getattr(torch, config.dtype))
            return Engine(
                model, base.tokenizer, config, weights_digest=base.weights_digest, name=base.model_name, store=store
            )

        # on a thread that ends, as Engine.from_pretrained builds: the harness's thread keeps no OpenMP
        # pool beside the engine thread's (kvrag.engine.model.host)
        return on_own_thread(build)

    def reference(self, method: Method):
        """The engine of a method that reads no store but sets its own dtype (``full+dtype=float32``):
        the run's model in that dtype, with a store of its own (what it writes back is keyed by its
        dtype and would only take room in the run's store). Built once per method."""
        if method.name not in self._references:
            config = self.base.config.replace(**{"tree_refresh": False, **method.overrides})
            self._references[method.name] = self._build(config)
        return self._references[method.name]

    @staticmethod
    def _own_dtype(method: Method) -> bool:
        return "dtype" in method.overrides

    def shared(self, method: Method):
        """The engine ``method`` runs on over the run's store, built with the method's overrides.

        Every method gets an engine of its own (over the same store, so what was warmed there is
        found): its variant index and exact-prefix cache are its own, so what one method keeps
        from a request (the variants of chunks it recomputed whole, its prompt's prefix) never
        serves another method's run of the same request. ``tree_refresh`` is off unless the method
        sets it: it acts after a request, and these workloads ask each prompt once per method, so
        it could only serve the method's own scoring of the request it just ran (and it costs a
        prefill per request).
        """
        if self._own_dtype(method):
            return self.reference(method)
        store_fields = sorted(STORE_FIELDS & method.overrides.keys())
        if store_fields:
            raise InvalidRequestError(
                f"method {method.name!r} overrides {', '.join(store_fields)}, a setting of the store, which "
                "its methods share in this workload; store settings per method need workloads b or r"
            )
        if method.name not in self._shared:
            config = self.base.config.replace(**{"tree_refresh": False, **method.overrides})
            self._shared[method.name] = self._build(config, store=self.base.store)
        return self._shared[method.name]

    def own(self, name: str, method: Method, **store_settings):
        """A new engine with a store of its own for the rows filed as ``name``.

        ``store_settings`` (budgets, policy) come first; the method's overrides go over them.
        """
        if name in self._own:
            raise InvalidRequestError(f"two engines for {name!r}")
        settings = dict(store_settings, **method.overrides)
        if settings.get("disk_tier", self.base.config.disk_tier):
            if self._scratch is None:
                self._scratch = scratch_dir()
            slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name)
            settings["cache_dir"] = os.path.join(self._scratch.name, f"{len(self._own)}-{slug}")
        self._own[name] = self._build(self.base.config.replace(**settings))
        return self._own[name]

    def scratch(self, **settings):
        """An engine with a store of its own that no method runs on (closed with the others):
        e.g. one warm computed once and copied into every method's store."""
        if self._scratch is None:
            self._scratch = scratch_dir()
        settings["cache_dir"] = os.path.join(self._scratch.name, f"scratch-{len(self._spare)}")
        engine = self._build(self.base.config.replace(**settings))
        self._spare.append(engine)
        return engine

    def discard(self, engine) -> None:
        """Close a :meth:`scratch` engine now, its store emptied (memory and disk): a warm's copy
        source is not held through the run beside the stores it filled."""
        self._spare.remove(engine)
        engine.store.clear()
        engine.close()

    def runners(self, methods: list[Method], settings: dict[str, dict]) -> list[tuple[str, Method, object]]:
        """``(row name, method, engine)`` per method, in order, for workloads of stores of their own.

        A method that uses no store runs on the run's engine (or, with a dtype of its own, on its
        :meth:`reference` engine). Every other one gets an engine per
        entry of ``settings`` (store settings by label), filed as ``method/label`` when there are
        several entries (``blend/lru``, ``blend/pgdsf``), else as the method.
        """
        out: list[tuple[str, Method, object]] = []
        for m in methods:
            if not m.uses_store:
                out.append((m.name, m, self.reference(m) if self._own_dtype(m) else self.base))
                continue
            for label, store in settings.items():
                name = m.name if len(settings) == 1 else f"{m.name}/{label}"
                out.append((name, m, self.own(name, m, **store)))
        return out

    @property
    def owned(self) -> dict[str, object]:
        """Row name -> engine with a store of its own, in the order built."""
        return dict(self._own)

    def close(self) -> None:
        """Close the engines with stores of their own (and the references'); the others only finish their write-back
        (their store is the run's engine's, closed by its owner)."""
        for engine in [*self._own.values(), *self._spare, *self._references.values()]:
            engine.close()
        for engine in self._shared.values():
            engine.flush()
        self._own.clear()
        self._shared.clear()
        self._references.clear()
        self._spare.clear()
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

    def __enter__(self) -> MethodEngines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
