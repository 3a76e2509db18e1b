"""Constrained decoding: what a JSON-schema constraint costs decode, and what each grammar library costs a token.

    python -m benchmarks constrained [--model M ...] [--only throughput,masks] [--streams 8]
                                     [--max-new-tokens 48] [--repeat 2] [--draft-tokens 0] [--out F.json]

- **throughput** (per model): decode tokens/s of the same prompts with and without
  ``Constraint.json_schema(SCHEMA)``, 1 stream and ``--streams`` streams started together (counted
  over the window in which every stream of the run decodes, as ``python -m benchmarks serving``
  does). Both run exactly ``--max-new-tokens`` tokens: the free runs with ``ignore_eos``, the
  constrained ones under a schema that needs more tokens than that (a long array of objects), so
  the batch stays full and the contexts match. Conditions alternate per repeat (ABBA); medians and
  the constrained/free ratio are reported, and the share of the constrained decode (first token to
  last) the engine spent in the grammar (mask, advance, draft checks; timed in-process, so a busy
  machine slows it no more than the decode around it). ``--draft-tokens 0`` (default) isolates the mask's cost
  from how prompt-lookup drafts hold on either text.
- **masks** (per model's tokenizer): per library installed (llguidance, the engine's; xgrammar;
  outlines-core), the time to make its tokenizer view, to compile MASK_SCHEMA (SCHEMA, any number
  of items), and to compute the next token's mask while consuming a fixed JSON answer token by token
  (median, mean, max), for a first matcher and again for a second one from the same compilation. The
  engine's own step (mask + masked_fill over the vocabulary) is timed too.

The machine may be shared: the load average is recorded before and after each measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

__all__ = ["SCHEMA", "MASK_SCHEMA", "measure_throughput", "measure_masks", "main"]

#: More structure than the free text has, and more tokens than a run decodes: the batch stays full.
SCHEMA = {
    "type": "object",
    "properties": {
        "passages": {
            "type": "array",
            "minItems": 200,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 99},
                    "quote": {"type": "string", "maxLength": 60},
                    "relevant": {"type": "boolean"},
                },
                "required": ["id", "quote", "relevant"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["passages"],
    "additionalProperties": False,
}

#: The schema the masks are timed on: SCHEMA, any number of items.
MASK_SCHEMA = {**SCHEMA, "properties": {"passages": {**SCHEMA["properties"]["passages"], "minItems": 1}}}

#: The answer the masks are timed on (consumed token by token; valid against MASK_SCHEMA).
ANSWER = {
    "passages": [
        {"id": 3, "quote": "The Eiffel Tower was finished in 1889 for the World's Fair.", "relevant": True},
        {"id": 7, "quote": "Gustave Eiffel's company designed and built it.", "relevant": True},
        {"id": 12, "quote": "Paris hosted the Exposition Universelle.", "relevant": False},
    ]
}

_QUESTION = (
    "List every passage about the Eiffel Tower as JSON: an object with key passages, a list of objects "
    "with id, quote and relevant. Passage {i}: the tower was finished in 1889; its designer was Gustave Eiffel."
)


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


class _GrammarClock:
    """Seconds the engine spends in the grammar (mask, advance, draft checks) while installed: the
    constraint's own cost, measured beside the decode it slows (a share robust to a busy machine)."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def __enter__(self) -> _GrammarClock:
        from kvrag.engine.model.grammar import GrammarMatcher

        self._saved = {name: getattr(GrammarMatcher, name) for name in ("mask", "advance", "allowed")}
        for name, f in self._saved.items():
            setattr(GrammarMatcher, name, self._timed(f))
        return self

    def _timed(self, f):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        return timed

    def __exit__(self, *exc) -> None:
        from kvrag.engine.model.grammar import GrammarMatcher

        for name, f in self._saved.items():
            setattr(GrammarMatcher, name, f)


def _run(engine, n: int, max_new_tokens: int, constraint) -> dict:
    """``n`` streams started together: decode tokens/s over the window in which all of them decode, and
    the share of the whole decode (first token to last) spent in the grammar."""
    import threading

    prompts = [engine.apply_chat_template([{"role": "user", "content": _QUESTION.format(i=i)}]) for i in range(n)]
    kw = {"constraint": constraint} if constraint is not None else {"ignore_eos": True}
    streams = [engine.stream(prompt=p, max_new_tokens=max_new_tokens, mode="full", **kw) for p in prompts]
    times: list[list[float]] = [[] for _ in streams]

    def consume(i):
        for _ in streams[i]:
            times[i].append(time.perf_counter())

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(n)]
    with _GrammarClock() as clock:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    begin, end = max(t[0] for t in times), min(t[-1] for t in times)
    span = max(t[-1] for t in times) - min(t[0] for t in times)
    pieces = sum(sum(begin < x <= end for x in t) for t in times)
    gens = [s.generation for s in streams]
    return {
        "streams": n,
        "window_s": end - begin,
        "pieces": pieces,
        "tokens_per_s": pieces / max(end - begin, 1e-9),
        "tokens": [len(g.token_ids) for g in gens],
        "finish": [g.finish_reason for g in gens],
        "grammar_s": clock.seconds,
        "grammar_calls": clock.calls,
        "grammar_share": clock.seconds / max(span, 1e-9),
        "load_before": None,
    }


def measure_throughput(engine, *, streams: int, max_new_tokens: int, repeat: int) -> dict:
    """Decode tokens/s with and without the JSON-schema constraint, 1 and ``streams`` streams, ABBA order."""
    from kvrag import Constraint

    constraint = Constraint.json_schema(SCHEMA)
    engine.generate(prompt="warm up", max_new_tokens=4, constraint=constraint)  # tokenizer view and compilation
    engine.generate(prompt="warm up", max_new_tokens=4)
    out: dict = {}
    for n in (1, streams):
        runs: dict[str, list[dict]] = {"free": [], "constrained": []}
        for rep in range(repeat):
            order = ("free", "constrained") if rep % 2 == 0 else ("constrained", "free")
            for name in order:
                load = _load()
                r = _run(engine, n, max_new_tokens, constraint if name == "constrained" else None)
                r["load_before"], r["load_after"] = load, _load()
                runs[name].append(r)
        free = statistics.median(r["tokens_per_s"] for r in runs["free"])
        bound = statistics.median(r["tokens_per_s"] for r in runs["constrained"])
        out[f"streams_{n}"] = {
            "free_tokens_per_s": free,
            "constrained_tokens_per_s": bound,
            "ratio": bound / free,
            "grammar_share": statistics.median(r["grammar_share"] for r in runs["constrained"]),
            "runs": runs,
        }
    return out


def _timed(f, ids) -> list[float]:
    out = []
    for t in ids:
        t0 = time.perf_counter()
        f(t)
        out.append(time.perf_counter() - t0)
    return out


def _summary(name: str, make_s: float, compile_s: float, per_token: list[float], again: list[float]) -> dict:
    """``per_token``: a first matcher's steps over the answer; ``again``: a second matcher's, from the same
    compiled grammar (what a later request with the same schema costs: lazily built lexer states are kept)."""
    return {
        "library": name,
        "tokenizer_s": make_s,
        "compile_s": compile_s,
        "mask_median_us": statistics.median(per_token) * 1e6,
        "mask_mean_us": statistics.mean(per_token) * 1e6,
        "mask_max_us": max(per_token) * 1e6,
        "again_median_us": statistics.median(again) * 1e6,
        "again_mean_us": statistics.mean(again) * 1e6,
        "again_max_us": max(again) * 1e6,
    }


def measure_masks(tokenizer, vocab_size: int, eos_ids) -> list[dict]:
    """Per library installed: tokenizer view, schema compilation and per-token mask times on ``tokenizer``."""
    import numpy as np
    import torch

    ids = tokenizer.encode(json.dumps(ANSWER), add_special_tokens=False)
    rows = []
    import llguidance
    import llguidance.hf

    t0 = time.perf_counter()
    ll_tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids))
    t1 = time.perf_counter()
    compiled = llguidance.LLMatcher(ll_tok, llguidance.LLMatcher.grammar_from_json_schema(MASK_SCHEMA), log_level=0)
    t2 = time.perf_counter()
    bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def ll_pass():
        m = compiled.deep_copy()

        def step(t):
            m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            if not m.consume_token(t):
                raise RuntimeError(m.get_error())

        return _timed(step, ids)

    rows.append(_summary("llguidance", t1 - t0, t2 - t1, ll_pass(), ll_pass()))
    from kvrag import Constraint
    from kvrag.engine.model.grammar import Grammars

    grammars = Grammars(tokenizer, eos_ids, vocab_size)
    grammars._ll_tokenizer = ll_tok
    logits = torch.zeros(vocab_size)

    def engine_pass():
        matcher = grammars.matcher(Constraint.json_schema(MASK_SCHEMA))

        def step(t):
            matcher.mask(logits)
            matcher.advance(t)

        return _timed(step, ids)

    rows.append(_summary("kvrag (llguidance mask + masked_fill)", 0.0, 0.0, engine_pass(), engine_pass()))
    try:
        import xgrammar as xgr
    except ImportError:
        xgr = None
    if xgr is not None:
        t0 = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        compiler = xgr.GrammarCompiler(info, max_threads=1)
        t1 = time.perf_counter()
        grammar = compiler.compile_json_schema(json.dumps(MASK_SCHEMA))
        t2 = time.perf_counter()
        mask = xgr.allocate_token_bitmask(1, info.vocab_size)

        def xgr_pass():
            xm = xgr.GrammarMatcher(grammar)

            def step(t):
                xm.fill_next_token_bitmask(mask)
                if not xm.accept_token(t):
                    raise RuntimeError(f"xgrammar refused token {t}")

            return _timed(step, ids)

        rows.append(_summary("xgrammar", t1 - t0, t2 - t1, xgr_pass(), xgr_pass()))
    try:
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        Guide = None
    if Guide is not None:
        rows.append(_outlines(tokenizer, vocab_size, ids, Guide, Index, Vocabulary, build_regex_from_schema))
    return rows


def _outlines(tokenizer, vocab_size, ids, Guide, Index, Vocabulary, build_regex) -> dict:
    import torch
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    t0 = time.perf_counter()
    byte_of = {v: k for k, v in bytes_to_unicode().items()}  # byte-level BPE's printable alphabet -> bytes
    special = set(tokenizer.all_special_ids)
    vocab: dict[bytes, list[int]] = {}
    for token, i in tokenizer.get_vocab().items():
        if i not in special and all(c in byte_of for c in token):
            vocab.setdefault(bytes(byte_of[c] for c in token), []).append(i)
    voc = Vocabulary(tokenizer.eos_token_id, vocab)
    t1 = time.perf_counter()
    index = Index(build_regex(json.dumps(MASK_SCHEMA)), voc)
    t2 = time.perf_counter()
    mask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)

    def one_pass():
        guide = Guide(index)

        def step(t):
            guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
            guide.advance(t)

        return _timed(step, ids)

    return _summary("outlines-core (regex of the schema)", t1 - t0, t2 - t1, one_pass(), one_pass())


def main(argv: list[str] | None = None) -> int:
    import torch

    from kvrag import Engine

    p = argparse.ArgumentParser(prog="python -m benchmarks constrained", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", default=None, help="a model name or .gguf path (repeatable)")
    p.add_argument("--only", default="throughput,masks")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--draft-tokens", type=int, default=0, help="the engine's draft_tokens (0: the mask's cost alone)")
    p.add_argument("--out", default=None, help="write every figure as JSON here")
    a = p.parse_args(argv)
    only = set(a.only.split(","))
    results: dict = {"config": dict(vars(a)), "models": []}
    for model in a.model or [None]:
        with Engine.from_pretrained(model, draft_tokens=a.draft_tokens) as engine:
            info = engine.info()
            row: dict = {"model": info.model, "dtype": info.dtype, "threads": torch.get_num_threads()}
            print(f"== {info.model} ({info.dtype}, decode: {info.decode})", flush=True)
            if "masks" in only:
                vocab = int(engine.adapter.lm_head_weight.shape[0])
                row["masks"] = measure_masks(engine.tokenizer, vocab, engine.eos_ids)
                for m in row["masks"]:
                    print(
                        f"  {m['library']}: tokenizer view {m['tokenizer_s'] * 1e3:.0f} ms, compile "
                        f"{m['compile_s'] * 1e3:.1f} ms, mask per token median {m['mask_median_us']:.0f} us "
                        f"(mean {m['mask_mean_us']:.0f}, max {m['mask_max_us']:.0f}); again: median "
                        f"{m['again_median_us']:.0f} us (mean {m['again_mean_us']:.0f}, max {m['again_max_us']:.0f})",
                        flush=True,
                    )
            if "throughput" in only:
                row["throughput"] = measure_throughput(
                    engine, streams=a.streams, max_new_tokens=a.max_new_tokens, repeat=a.repeat
                )
                for key, t in row["throughput"].items():
                    print(
                        f"  {key}: free {t['free_tokens_per_s']:.2f} tok/s, constrained "
                        f"{t['constrained_tokens_per_s']:.2f} tok/s, ratio {t['ratio']:.3f}; the grammar's "
                        f"share of the constrained decode {t['grammar_share']:.2%}",
                        flush=True,
                    )
            results["models"].append(row)
            if a.out:  # after each model: a long run cut short keeps what it measured
                Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
