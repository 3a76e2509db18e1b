"""Small models and data the tests build themselves."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Iterator

import torch

WORDS = (
    "river mountain castle library engine harbor museum garden bridge market village forest "
    "island desert valley tower palace temple school station college theatre stadium canal "
    "the of and in to was is by for with on at from as an a which that his her their it "
    "born founded built named located known famous first largest oldest river capital city "
    "king queen author painter composer scientist engineer general mayor bishop poet "
    "France Spain Italy Egypt Peru Japan Kenya Chile Norway Brazil London Paris Rome Cairo Lima "
    "1820 1901 1954 1776 1492 2001 seven twelve hundred north south east west"
).split()


def make_tokenizer():
    """A byte-level BPE tokenizer trained in a few milliseconds, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(200)]
    tok.train_from_iterator(corpus, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return hf


#: Per family, what its tiny test model sets beyond the shared small dimensions. Windows are
#: shorter than the test prompts (~300 tokens), so that sliding-window attention matters; Gemma 3
#: mixes sliding and global layers, each kind with its own RoPE.
FAMILY_CONFIGS = {
    "llama": {},
    "mistral": dict(sliding_window=48),
    "qwen2": dict(use_sliding_window=True, sliding_window=48, max_window_layers=3),
    "qwen3": dict(head_dim=32),
    "gemma3_text": dict(
        head_dim=32,
        sliding_window=40,
        layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"],
        query_pre_attn_scalar=24,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    ),
}
FAMILIES = tuple(FAMILY_CONFIGS)


def make_tiny_model(vocab_size: int, family: str = "llama", *, layers: int = 6, seed: int = 0, **overrides):
    """A random model of a family, built offline from ``AutoConfig.for_model``, small enough for
    fast tests. Weights are scaled so that attention is not uniform, and norms and biases (zero or
    one at init) are randomised so that a norm or bias applied wrongly shows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.15,
    )
    if family == "llama":
        cfg["rope_theta"] = 10000.0
    cfg.update(FAMILY_CONFIGS[family])
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **cfg)).eval()
    if family != "llama":  # the Llama fixture keeps the weights the older tests were tuned on
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith(".bias"):
                    p.add_(torch.randn_like(p) * 0.2)
    model.config._attn_implementation = "sdpa"
    return model


def as_dtype(model, dtype: str):
    """``model`` itself for float32, else a copy converted to ``dtype`` (``Engine.from_model`` computes
    in the weights' own dtype; session fixtures are shared, so they are never converted in place)."""
    import copy

    return model if dtype == "float32" else copy.deepcopy(model).to(getattr(torch, dtype))


def make_docs(n: int, words: int = 60, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) + "\n" for _ in range(n)]


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


def last_logits(engine, chunks, mode, ratio=None, selection=None):
    """The prompt's last-token logits [V] after a prefill in ``mode`` (the engine's own request path)."""
    from kvrag.engine.model.sampling import SamplingParams

    req = engine._request(
        chunks=chunks,
        prefix=PREFIX,
        suffix=SUFFIX,
        sampling=SamplingParams(max_new_tokens=0),
        mode=mode,
        recompute_ratio=ratio,
        selection=selection,
    )
    assert torch.equal(req.ids, prompt_ids(engine, chunks)), "kvrag's prompt differs from the tokenizer's"
    _, res = engine._prefill(req, capacity=int(req.ids.shape[0]))
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
