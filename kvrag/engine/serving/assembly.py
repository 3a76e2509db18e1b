"""The engine's parts, wired once: the cache's view of the prompt (reuse layer) and the engine thread
with what it drives (serving layer). :class:`kvrag.Engine` builds the model's side (weights, dtype,
fingerprint, the gate, the store) and hands it here."""

from __future__ import annotations

import atexit
import logging
import weakref
from dataclasses import dataclass

import torch

from kvrag.config import EngineConfig
from kvrag.engine.model.adapter import ModelAdapter
from kvrag.engine.model.batch import Decoder
from kvrag.engine.model.grammar import Grammars
from kvrag.engine.model.quantized import cache_file, decode_weights
from kvrag.engine.reuse.access import AccessTable
from kvrag.engine.reuse.chunks import ChunkComputer, context_label
from kvrag.engine.reuse.conversations import Conversations
from kvrag.engine.reuse.documents import DocumentFinder
from kvrag.engine.reuse.gate import GateResult
from kvrag.engine.reuse.planner import Planner
from kvrag.engine.reuse.prefix import PrefixCache
from kvrag.engine.reuse.segments import PromptTokenizer
from kvrag.engine.reuse.variants import StoredVariants, VariantIndex
from kvrag.engine.serving.costs import CostFeedback
from kvrag.engine.serving.decode import Decoding
from kvrag.engine.serving.prefill import Prefiller
from kvrag.engine.serving.requests import Requests
from kvrag.engine.serving.scheduler import Scheduler, Ticket
from kvrag.engine.serving.speculation import Speculations
from kvrag.engine.serving.warming import Warming
from kvrag.engine.serving.worker import Worker
from kvrag.engine.serving.writeback import WriteBack
from kvrag.engine.store.base import KVStore

log = logging.getLogger(__name__)

__all__ = ["Parts", "assemble", "EXIT_WAIT_S"]

#: Parts of engines not closed yet: at interpreter exit their threads are let finish first.
_LIVE: weakref.WeakSet = weakref.WeakSet()

#: Seconds an engine may take at interpreter exit to finish what it runs.
EXIT_WAIT_S = 60.0


@atexit.register
def _quiesce_at_exit() -> None:
    """Let live engines' threads end before the interpreter tears down: a daemon thread still inside a
    torch op while the interpreter finalises aborts the process (exit code 134). Refreshes not started
    are dropped; running work and write-back finish (bounded by ``EXIT_WAIT_S``)."""
    for parts in list(_LIVE):
        try:
            parts.quiesce(EXIT_WAIT_S)
        except Exception:  # exiting anyway: never fail the interpreter's shutdown
            log.debug("kvrag: an engine did not finish at exit", exc_info=True)


@dataclass(eq=False)  # a weak reference marks it live (the exit hook); compared by identity
class Parts:
    """What an engine is made of, below its model (each a module's object; see docs/how-it-works.md)."""

    prompt_tokenizer: PromptTokenizer
    documents: DocumentFinder
    variants: StoredVariants
    planner: Planner
    chunk_computer: ChunkComputer
    conversations: Conversations
    access: AccessTable
    costs: CostFeedback
    requests: Requests
    scheduler: Scheduler
    worker: Worker
    writeback: WriteBack
    speculations: Speculations
    prefiller: Prefiller
    warming: Warming
    decoding: Decoding

    def close(self) -> None:
        """Let queued and running work finish, finish write-back, end the engine thread."""
        _LIVE.discard(self)
        self.speculations.cancel_all()
        self.writeback.cancel_refreshes()  # background work not started yet is not worth waiting for
        self.worker.wait_idle()
        self.writeback.close()  # its chunk computations still run on the engine thread
        self.worker.stop()  # the thread, idle now, ends instead of lingering

    def quiesce(self, timeout: float) -> None:
        """Drop refreshes not started, let running work and write-back finish (the exit hook)."""
        self.speculations.cancel_all()
        self.writeback.cancel_refreshes()
        if self.worker.wait_idle(timeout=timeout):
            self.writeback.flush()
            self.worker.stop(timeout=timeout)  # no engine thread lingers into the interpreter's teardown


def assemble(
    config: EngineConfig,
    adapter: ModelAdapter,
    tokenizer,
    store: KVStore,
    gate: GateResult,
    *,
    fingerprint: str,
    sink_ids: list[int],
    eos_ids: set[int],
    context_window: int,
    model_name: str,
    threads: int,
    drafts_given: bool,
    quantized_source: bool = False,
) -> Parts:
    """Build and wire the parts of an engine over ``adapter`` and ``store``; its engine thread computes
    with ``threads`` torch threads, whatever the caller's threads set later. ``quantized_source``: the
    weights came quantized (the decode step's ``weights="auto"``)."""
    prompt_tokenizer = PromptTokenizer(tokenizer)
    kv_shape = (adapter.n_layers, adapter.n_kv_heads, adapter.head_dim)
    variants = StoredVariants(store, VariantIndex(config.max_variants), kv_shape)
    planner = Planner(
        variants,
        PrefixCache(store, fingerprint, config.prefix_block_tokens),
        fingerprint=fingerprint,
        namespace=config.namespace,
        context_label=context_label(config.chunk_context, sink_ids),
        kv_shape=kv_shape,
        slice_tokens=config.deterministic_slice_tokens if config.deterministic else 0,
    )
    computer = ChunkComputer(adapter, prompt_tokenizer.tokenize, sink_ids, config.chunk_context, context_window)
    documents = DocumentFinder(namespace=config.namespace)
    conversations = Conversations(adapter, config.max_conversations)
    #: CRAFT's chunk-access table: recent retrievals per namespace (frequency order, promotion)
    access = AccessTable(config.chunk_access_window, config.promotion_threshold)
    costs = CostFeedback(store, adapter.n_layers, config.loading_controller, config.cost_model, adapter.device.type)
    grammars = Grammars(tokenizer, eos_ids, int(adapter.lm_head_weight.shape[0]))  # constraints, compiled once each
    requests = Requests(config, prompt_tokenizer, documents, conversations, access, gate, grammars,
                        context_window=context_window, model_name=model_name)  # fmt: skip
    scheduler = Scheduler(
        max_running=config.max_running,
        max_queued=config.max_queued,
        max_queued_tokens=config.max_queued_tokens,
        starvation_window=config.starvation_window,
    )
    worker = Worker(
        scheduler=scheduler,
        eos_ids=eos_ids,
        slice_s=config.prefill_slice_s,
        setup=lambda: torch.set_num_threads(threads),
        linger_s=config.thread_linger_s,
    )

    def run(job, tokens: int, *, bounded: bool = True):  # a job on the engine thread, queued like a request
        return worker.call(Ticket(tokens=tokens, compute=tokens, bounded=bounded), job)

    writeback = WriteBack(
        config,
        store,
        planner,
        variants,
        computer,
        run=lambda job, tokens: run(job, tokens, bounded=False),  # internal work: never refused
        worker=worker,
        promoted=access.promoted,
        stored=access.stored,
        computed=access.computed,
    )
    speculations = Speculations(worker, adapter.n_layers, config.namespace)
    prefiller = Prefiller(config, adapter, planner, conversations, costs, writeback, speculations, prompt_tokenizer,
                          grammars, context_window=context_window)  # fmt: skip
    warming = Warming(config, prompt_tokenizer, computer, store, planner, variants, access, run, speculations,
                      context_window=context_window)  # fmt: skip
    fmt = decode_weights(config.weights, quantized_source)
    # a GGUF's decode weights are kept beside its conversion (read back instead of quantized again)
    cache = cache_file(config.resolved_cache_dir(), fingerprint, fmt) if quantized_source else None
    decoder = Decoder(adapter, config.decode_group, weights=fmt, cache=cache)
    decoding = Decoding(decoder, conversations, config.draft_tokens,
                        drafts_given=drafts_given)  # fmt: skip
    worker.drive(start=prefiller.start, step=decoding.step, finish=decoding.finish)
    parts = Parts(
        prompt_tokenizer, documents, variants, planner, computer, conversations, access, costs, requests, scheduler,
        worker, writeback, speculations, prefiller, warming, decoding,
    )  # fmt: skip
    _LIVE.add(parts)
    return parts
