"""Small models and data the tests build themselves."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch

from benchmarks.tiny import FAMILIES, FAMILY_CONFIGS, WORDS, make_docs, make_tiny_model, make_tokenizer  # noqa: F401


def as_dtype(model, dtype: str):
    """``model`` itself for float32, else a copy converted to ``dtype`` (``Engine.from_model`` computes
    in the weights' own dtype; session fixtures are shared, so they are never converted in place)."""
    import copy

    return model if dtype == "float32" else copy.deepcopy(model).to(getattr(torch, dtype))


PREFIX = "<|im_start|>system\nanswer from the documents<|im_end|>\n<|im_start|>user\n"
SUFFIX = "question: where was the king born?<|im_end|>\n<|im_start|>assistant\n"


def prompt_ids(engine, chunks, prefix=PREFIX, suffix=SUFFIX, *, bos: tuple[int, ...] = ()) -> torch.Tensor:
    """The token ids kvrag must prefill for ``prefix + chunks + suffix``, built from the tokenizer
    alone (not the planner): ``bos`` — given by the test, a fact about its tokenizer, not probed the
    way the planner probes it: none for the tiny test tokenizer (it has no post-processor), ``<bos>``
    for Gemma 3 —, then each part tokenised on its own (kvrag's rule: a chunk's tokens are the same
    wherever it appears)."""
    tok = engine.tokenizer
    ids = list(bos)
    for text in [prefix, *chunks, suffix]:
        ids += tok(text, add_special_tokens=False)["input_ids"] if text else []
    return torch.tensor(ids, dtype=torch.long)


def last_logits(engine, chunks, mode, ratio=None, selection=None, suffix=SUFFIX):
    """The prompt's last-token logits [V] after a prefill in ``mode`` (the engine's own request path)."""
    from kvrag import RequestOptions

    options = RequestOptions(max_new_tokens=0, mode=mode, recompute_ratio=ratio, selection=selection)
    req = engine.requests.build(chunks=chunks, prefix=PREFIX, suffix=suffix, options=options)
    assert torch.equal(req.ids, prompt_ids(engine, chunks, suffix=suffix)), (
        "kvrag's prompt differs from the tokenizer's"
    )
    _, _, res = engine.prefiller.run(req, capacity=req.num_tokens)
    return engine.adapter.logits(res.last_hidden)[0]


@contextlib.contextmanager
def running_server(app) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on a free loopback port, in a thread; yields its base URL."""
    import socket
    import threading

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(1500):  # up to 30 s for the server to listen (a loaded machine)
        if server.started or not thread.is_alive():
            break
        time.sleep(0.02)
    assert server.started, "the test server did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def failing_stream(*args, **kwargs):
    """A stand-in for ``Engine.stream``: yields ``"partial"``, then fails as an engine would mid-stream."""
    from kvrag.engine import GenerationStream
    from kvrag.errors import InvalidRequestError

    def pieces():
        yield "partial"
        raise InvalidRequestError("the engine gave up")

    return GenerationStream(pieces())


def hold_engine_thread(engine) -> threading.Event:
    """Occupy an engine's thread with a job that waits for the event returned (set it to go on)."""
    from kvrag.engine.serving.scheduler import Ticket

    gate, started = threading.Event(), threading.Event()

    def job(pause):
        started.set()
        gate.wait()

    threading.Thread(target=engine._worker.call, args=(Ticket(tokens=1, bounded=False), job), daemon=True).start()
    started.wait()
    return gate


def stored_contexts(engine, texts: list[str]) -> list[tuple[str, ...]]:
    """Per text, the context (ids of the chunks it was computed behind) of its first stored variant."""
    out = []
    for text in texts:
        key = engine.planner.chunk_key(engine.prompt_tokenizer.tokenize(text))
        out.append(tuple(engine.store.get(key).meta["context"]))
    return out


def kl_by_ratio(engine, selection: str, ratios=(0.0, 0.2, 0.5, 1.0), seeds=range(3)) -> dict[float, float]:
    """Per recompute ratio, KL(full || blend) of the last-token distribution under ``selection``,
    summed over a few warmed prompts (a selection's deviation from the full prefill as it spends more)."""
    errors = {r: 0.0 for r in ratios}
    for seed in seeds:
        chunks = make_docs(4, seed=seed + 10)
        engine.warm(chunks)
        ref = torch.log_softmax(last_logits(engine, chunks, "full"), -1)
        for r in errors:
            got = torch.log_softmax(last_logits(engine, chunks, "blend", r, selection), -1)
            errors[r] += float((ref.exp() * (ref - got)).sum())
    return errors


def placed_again(engine, monkeypatch, selection: str) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """A blend at 0.3 under ``selection``: the layers fusion placed again restoring only what a pass
    computed over, its last logits, and the same logits when every pass places its layer whole."""
    from kvrag.engine.reuse import fusion

    chunks = make_docs(4, seed=5)
    engine.warm(chunks)
    order = [chunks[i] for i in (3, 1, 0, 2)]
    restored: list[int] = []
    restore, fill = fusion.SpanSource._restore, fusion.SpanSource.fill
    monkeypatch.setattr(
        fusion.SpanSource, "_restore", lambda s, layer, buf: restored.append(layer) or restore(s, layer, buf)
    )
    fast = last_logits(engine, order, "blend", 0.3, selection)
    first = list(restored)  # the fast run's alone

    def fill_whole(self, layer, buf):  # every pass places the layer whole, as before
        self._placed.discard(layer)
        return fill(self, layer, buf)

    monkeypatch.setattr(fusion.SpanSource, "fill", fill_whole)
    return first, fast, last_logits(engine, order, "blend", 0.3, selection)


def probe_strides(monkeypatch) -> list[int]:
    """The block size of every probe sample taken from now on in this test (the probe's parameters in use)."""
    import kvrag.engine.reuse.selection.probe as probe_module

    strides: list[int] = []
    real = probe_module.probe_sample
    monkeypatch.setattr(
        probe_module, "probe_sample", lambda spans, n, stride: strides.append(stride) or real(spans, n, stride)
    )
    return strides


#: A chat template that renders tools and tool calls as Qwen2.5's does (``<tools>`` in the system turn,
#: ``<tool_call>`` JSON in assistant turns, ``<tool_response>`` in user turns), written short for tests.
QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}"
    "\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    'Call a function as <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    "<|im_end|>\n{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'assistant' and not m.tool_calls) %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant{% if m.content %}\n{{ m.content }}{% endif %}"
    "{%- for c in m.tool_calls %}\n<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tool_engine(family: str = "qwen2", template: str = QWEN_TOOLS_TEMPLATE, **config):
    """A tiny random model of ``family`` whose tokenizer's chat template is ``template`` (tools rendered)."""
    from kvrag import Engine, SamplingParams

    tok = make_tokenizer()
    tok.chat_template = template
    model = make_tiny_model(len(tok), family, layers=2)
    return Engine.from_model(model, tok, sampling=SamplingParams(max_new_tokens=8), **config)


def scripted_engine(answer: str, template: str = QWEN_TOOLS_TEMPLATE, model_type: str = "qwen2", size: int = 4):
    """An engine stand-in over the tiny tokenizer with ``template``: ``stream`` replays ``answer`` in pieces
    of ``size`` characters (a model's scripted text) and records each request's arguments in ``calls``."""
    from types import SimpleNamespace

    from kvrag.engine import Engine, Generation, GenerationStats, GenerationStream

    class ScriptedEngine(Engine):
        def __init__(self) -> None:  # no model: Engine.__init__ is not called
            from kvrag.config import EngineConfig

            self.model_name, self.context_window, self.config = "scripted", 4096, EngineConfig()
            self.hf_model = SimpleNamespace(config=SimpleNamespace(model_type=model_type))
            self.tokenizer = make_tokenizer()
            self.tokenizer.chat_template = template
            self.calls: list[dict] = []

        def stream(self, **kwargs) -> GenerationStream:
            self.calls.append(kwargs)
            return GenerationStream(self._run())

        def _run(self):
            for i in range(0, len(answer), size):
                yield answer[i : i + size]
            stats = GenerationStats(mode="blend", recompute_ratio=0.0, prompt_tokens=100, completion_tokens=5)
            return Generation(answer, [1], "stop", 0.1, 0.2, stats)

    return ScriptedEngine()
