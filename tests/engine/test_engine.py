"""Engine core on tiny random models: exactness (every family), fusion, reuse, decoding, errors."""

from __future__ import annotations

import copy
import threading
from importlib import resources
from types import SimpleNamespace

import pytest
import torch

from kvrag import ContextLengthError, Engine, InvalidRequestError, SamplingParams
from kvrag.engine.model.runner import KVBuffer, forward
from kvrag.engine.reuse.fusion import PrefillOptions, prefill
from kvrag.engine.reuse.gate import _rel_error, plain_cache
from tests.helpers import PREFIX, SUFFIX, as_dtype, kl_by_ratio, last_logits, make_docs, prompt_ids


def test_full_prefill_matches_transformers(family_engine, docs):
    ids = prompt_ids(family_engine, docs)
    ours = last_logits(family_engine, docs, "full")
    with torch.inference_mode():
        theirs = family_engine.hf_model(ids[None]).logits[0, -1].float()
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_all_positions_match_transformers(family_engine, docs):
    ad = family_engine.adapter
    ids = prompt_ids(family_engine, docs)
    n = int(ids.shape[0])
    assert any(w is not None and w < n for w in ad.windows) or ad.config.model_type in ("llama", "qwen3")
    buf = KVBuffer(ad, n)
    h, _ = forward(ad, buf, ids, torch.arange(n), n)
    with torch.inference_mode():  # a plain cache keeps every position of sliding-window layers too
        kw, cache = plain_cache(family_engine.hf_model)
        out = family_engine.hf_model(ids[None], use_cache=True, **kw)
    torch.testing.assert_close(ad.logits(h), out.logits[0].float(), rtol=1e-4, atol=1e-4)
    # the KV buffer equals transformers' cache (keys with RoPE applied)
    for layer in range(ad.n_layers):
        torch.testing.assert_close(buf.k[layer, :, :n], cache.layers[layer].keys[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(buf.v[layer, :, :n], cache.layers[layer].values[0], rtol=1e-4, atol=1e-5)


def test_a_pass_resumed_from_hidden_states_equals_one_pass(family_engine, docs):
    """forward over layers [0, L) then [L, end) from the hidden states equals one pass; with
    last_row_only the KV is the same and the last row's output too."""
    ad = family_engine.adapter
    ids = prompt_ids(family_engine, docs)
    n = int(ids.shape[0])
    one, split = KVBuffer(ad, n), KVBuffer(ad, n)
    h_one, _ = forward(ad, one, ids, torch.arange(n), n)
    h_mid, pos = forward(ad, split, ids, torch.arange(n), n, layers=(0, 2))
    assert h_mid.shape == h_one.shape and split.length == 0  # the buffer is not complete yet
    h_split, pos = forward(ad, split, None, pos, n, hidden=h_mid, layers=(2, ad.n_layers), last_row_only=True)
    assert torch.equal(split.k[:, :, :n], one.k[:, :, :n]) and torch.equal(split.v[:, :, :n], one.v[:, :, :n])
    assert h_split.shape[0] == 1 and pos.numel() == n and split.length == n
    torch.testing.assert_close(h_split, h_one[-1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ratio_one_is_exactly_full(family_model, tiny_tokenizer, docs, dtype):
    with Engine.from_model(
        as_dtype(family_model, dtype), tiny_tokenizer, sampling=SamplingParams(max_new_tokens=8)
    ) as engine:
        assert engine.info().dtype == dtype
        engine.warm(docs)
        full = engine.generate(docs, PREFIX, SUFFIX, mode="full", max_new_tokens=12)
        blend1 = engine.generate(docs, PREFIX, SUFFIX, mode="blend", recompute_ratio=1.0, max_new_tokens=12)
        assert blend1.token_ids == full.token_ids
        assert torch.equal(last_logits(engine, docs, "blend", 1.0), last_logits(engine, docs, "full"))
        assert blend1.stats.cached_tokens == 0 and blend1.stats.compute_fraction == 1.0


def test_bf16_full_prefill_is_transformers_bf16_forward(family_model, tiny_tokenizer, docs):
    """Same arithmetic as transformers in bf16 (RoPE tables rounded like its rotary module, RMSNorm
    in float32, SDPA): with global attention the same KV on every layer and the same logits, bit for
    bit. Sliding-window layers attend block by block over the window (transformers: one masked
    call), which rounds differently: there kvrag is as far from float32 as transformers' bf16 is."""
    model = as_dtype(family_model, "bfloat16")
    reference = copy.deepcopy(model).float()  # the same (bf16) weights, float32 arithmetic
    with Engine.from_model(model, tiny_tokenizer) as engine:
        ad, ids = engine.adapter, prompt_ids(engine, docs)
        n = int(ids.shape[0])
        buf = KVBuffer(ad, n)
        h, _ = forward(ad, buf, ids, torch.arange(n), n)
        ours = ad.logits(h[-1:])[0]
        with torch.inference_mode():
            (kw, theirs), (kw32, ref) = plain_cache(model), plain_cache(reference)
            theirs_logits = model(ids[None], use_cache=True, **kw).logits[0, -1].float()
            ref_logits = reference(ids[None], use_cache=True, **kw32).logits[0, -1]
    windowed = any(w is not None and w < n for w in ad.windows)
    for layer in range(ad.n_layers):
        for ours_t, theirs_t, ref_t in (
            (buf.k[layer, :, :n], theirs.layers[layer].keys[0], ref.layers[layer].keys[0]),
            (buf.v[layer, :, :n], theirs.layers[layer].values[0], ref.layers[layer].values[0]),
        ):
            if not windowed:
                assert torch.equal(ours_t, theirs_t), layer
            assert _rel_error(ours_t, ref_t) <= 1.1 * _rel_error(theirs_t, ref_t), layer
    if not windowed:
        assert torch.equal(ours, theirs_logits)
    assert _rel_error(ours, ref_logits) <= 1.5 * _rel_error(theirs_logits, ref_logits)


def test_cached_keys_moved_to_new_positions_equal_keys_computed_there(family_model, tiny_tokenizer, docs):
    """A chunk's KV computed alone behind the sink token (stored without RoPE) and placed at its
    place in the prompt equals, on every layer, the KV transformers computes for the sink and the
    chunk at those positions (the same context, shifted): RoPE is each layer's own."""
    engine = Engine.from_model(family_model, tiny_tokenizer, chunk_context="sink")
    try:
        engine.warm(docs)
        ids = prompt_ids(engine, docs)
        n = int(ids.shape[0])
        parts = [("text", PREFIX)] + [("chunk", c) for c in docs] + [("text", SUFFIX)]
        segments, _ = engine.prompt_tokenizer.segment(parts)
        plan = engine.planner.plan(segments, mode="reuse", use_prefix=False)
        res = prefill(engine.adapter, plan, n, options=PrefillOptions())
        assert len(plan.chunk_records) == len(docs)
        for start, rec in plan.chunk_records:
            end = start + rec.num_tokens
            assert start > 1  # not where they were computed
            alone = torch.tensor([engine.sink_ids + rec.token_ids.tolist()])
            with torch.inference_mode():
                kw, cache = plain_cache(engine.hf_model)
                engine.hf_model(alone, position_ids=torch.arange(start - 1, end)[None], **kw)
            for layer, theirs in enumerate(cache.layers):
                torch.testing.assert_close(res.buf.k[layer, :, start:end], theirs.keys[0, :, 1:], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(
                    res.buf.v[layer, :, start:end], theirs.values[0, :, 1:], rtol=1e-4, atol=1e-4
                )
    finally:
        engine.close()


@pytest.mark.parametrize("selection", ["probe", "recency"])
def test_deviation_from_full_shrinks_as_ratio_grows(tiny_engine, selection):
    errors = kl_by_ratio(tiny_engine, selection)  # KL(full || blend) per ratio (the benchmarks' selections too)
    assert errors[1.0] == 0.0
    assert errors[0.0] > errors[0.2] > errors[0.5] > errors[1.0]


def test_warm_then_hits(family_engine, docs):
    cold = family_engine.generate(docs, PREFIX, SUFFIX)
    assert cold.stats.chunk_hits == 0 and cold.stats.chunk_misses == len(docs)
    w = family_engine.warm(docs[:2])  # before write-back of the cold request can have stored them
    family_engine.flush()
    assert w.tokens == sum(family_engine.count_tokens(d) for d in docs[:2])
    again = family_engine.warm(docs)  # write-back has kept every chunk the cold request missed
    assert (again.computed, again.cached) == (0, len(docs))
    hot = family_engine.generate(list(reversed(docs)), PREFIX, SUFFIX)
    assert hot.stats.chunk_hits == len(docs) and hot.stats.chunk_misses == 0
    assert hot.stats.cached_tokens >= sum(family_engine.count_tokens(d) for d in docs)
    assert 0 < hot.stats.recomputed_tokens < hot.stats.cached_tokens
    assert hot.stats.compute_fraction < 0.7


def test_warm_computes_what_is_missing(tiny_engine):
    docs = make_docs(3, seed=21)
    assert (tiny_engine.warm(docs).computed, tiny_engine.warm(docs).computed) == (3, 0)
    tiny_engine.store.remove(tiny_engine.planner.chunk_key(tiny_engine.prompt_tokenizer.tokenize(docs[1])))
    w = tiny_engine.warm(docs + docs[:1])  # a repeat in the list is one chunk
    assert (w.computed, w.cached) == (1, 3)


def flat(docs):
    return [t for d in docs for t in d]


def chunk_kv_in_stream(engine, context: list[int], stream: list[list[int]]):
    """The pre-RoPE K and V ([L, Hkv, T, D]) that transformers' own forward over ``context + stream``
    gives the stream's last document, read from the k/v projections with forward hooks."""
    ids = context + flat(stream)
    last = len(stream[-1])
    layers = engine.hf_model.model.layers
    heads, dim = engine.adapter.n_kv_heads, engine.adapter.head_dim
    seen: dict[str, list[torch.Tensor]] = {"k": [], "v": []}

    def hook(name):
        def keep(module, args, out):  # out [1, T, Hkv * D]
            seen[name].append(out[0, -last:].view(last, heads, dim).transpose(0, 1))

        return keep

    handles = [layer.self_attn.k_proj.register_forward_hook(hook("k")) for layer in layers]
    handles += [layer.self_attn.v_proj.register_forward_hook(hook("v")) for layer in layers]
    try:
        with torch.inference_mode():
            engine.hf_model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return SimpleNamespace(k=torch.stack(seen["k"]), v=torch.stack(seen["v"]))


def stored(engine, text):
    ids = engine.prompt_tokenizer.tokenize(text)
    return engine.store.get(engine.planner.chunk_key(ids), ids)


def builtin_context(engine) -> list[int]:
    """BOS + the last quarter-window of tokens of the built-in passage kvrag ships."""
    text = resources.files("kvrag.engine.reuse").joinpath("data/context.txt").read_text(encoding="utf-8")
    passage = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    return [engine.tokenizer.bos_token_id] + passage[-(engine.context_window // 4) :]


def test_warm_computes_each_chunk_behind_the_ones_before_it(tiny_engine):
    """chunk_context='neighbor': warm() computes its list as one stream; each chunk keeps the KV it
    has in that stream. A list that fits one window goes behind a built-in passage (no other
    documents are known to a fresh engine), later behind the documents computed last that are not
    in the window."""
    docs = make_docs(4, words=150, seed=3)
    w = tiny_engine.warm(docs)
    assert (w.computed, w.cached) == (len(docs), 0)
    cc = tiny_engine.chunk_computer
    ids = [tiny_engine.prompt_tokenizer.tokenize(d) for d in docs]
    assert cc.windows(ids, tiny_engine.context_window) == [[0, 1, 2, 3]]
    context = builtin_context(tiny_engine)
    for i in (0, len(docs) - 1):
        want = chunk_kv_in_stream(tiny_engine, context, ids[: i + 1])
        rec = stored(tiny_engine, docs[i])
        torch.testing.assert_close(rec.k, want.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rec.v, want.v, rtol=1e-5, atol=1e-5)
    assert tiny_engine.warm(docs[::-1]).computed == 0  # another order is no work
    tiny_engine.store.remove(tiny_engine.planner.chunk_key(ids[2]))
    w = tiny_engine.warm(docs)
    assert (w.computed, w.cached) == (1, len(docs) - 1)
    # the documents computed last are this very list: a chunk never goes behind a copy of itself
    want = chunk_kv_in_stream(tiny_engine, context, ids[:3])
    torch.testing.assert_close(stored(tiny_engine, docs[2]).k, want.k, rtol=1e-5, atol=1e-5)
    others = make_docs(2, words=150, seed=11)  # other documents computed last: behind those
    tiny_engine.warm(others)
    tiny_engine.store.remove(tiny_engine.planner.chunk_key(ids[2]))
    assert tiny_engine.warm(docs).computed == 1
    recent = flat(tiny_engine.prompt_tokenizer.tokenize(d) for d in others)[-(tiny_engine.context_window // 4) :]
    want = chunk_kv_in_stream(tiny_engine, [tiny_engine.tokenizer.bos_token_id] + recent, ids[:3])
    torch.testing.assert_close(stored(tiny_engine, docs[2]).k, want.k, rtol=1e-5, atol=1e-5)


def test_warm_splits_long_lists_into_windows(tiny_model, tiny_tokenizer, docs):
    two = 280  # room for two of these documents behind 3/8 of it in context, not for three
    engine = Engine.from_model(
        tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=8), warm_window_tokens=two
    )
    try:
        cc = engine.chunk_computer
        ids = [engine.prompt_tokenizer.tokenize(d) for d in docs]
        room = cc.window_context_tokens(two)
        assert room == 3 * two // 8 < cc.context_tokens
        assert (
            len(cc.sink_ids) + room + sum(map(len, ids[:2])) <= two < len(cc.sink_ids) + room + sum(map(len, ids[:3]))
        )
        assert cc.windows(ids, two) == [[0, 1], [2, 3]]
        assert cc.windows(ids, 1) == [[0], [1], [2], [3]]  # a chunk longer than the window is alone
        assert cc.windows(ids, 10**6) == [[0, 1, 2, 3]]
        # a window goes behind the other documents of the list, round it, ending just before the
        # window, as many of their last tokens as 3/8 of the window holds
        engine.warm(docs)
        for members, others in (([0, 1], [2, 3]), ([2, 3], [0, 1])):
            context = [engine.tokenizer.bos_token_id] + flat(ids[j] for j in others)[-room:]
            want = chunk_kv_in_stream(engine, context, [ids[j] for j in members])
            torch.testing.assert_close(stored(engine, docs[members[-1]]).k, want.k, rtol=1e-5, atol=1e-5)
    finally:
        engine.close()


def test_warm_variants_adds_a_reverse_pass(tiny_model, tiny_tokenizer, docs):
    """warm_variants=2: the list is computed again in reverse, each chunk kept as a second variant
    behind the documents after it; a second warm computes nothing."""
    two = 280
    engine = Engine.from_model(
        tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=8), warm_window_tokens=two, warm_variants=2
    )
    try:
        ids = [engine.prompt_tokenizer.tokenize(d) for d in docs]
        room = engine.chunk_computer.window_context_tokens(two)
        res = engine.warm(docs)
        assert (res.computed, res.variants) == (4, 4)
        keys = [engine.planner.chunk_key(i) for i in ids]
        assert all(len(engine.variants.index.keys(k)) == 2 for k in keys)
        # reversed list [3, 2, 1, 0] in windows [3, 2] and [1, 0]; [3, 2] goes behind 1, 0 (round it)
        for members, others in (([3, 2], [1, 0]), ([1, 0], [3, 2])):
            context = [engine.tokenizer.bos_token_id] + flat(ids[j] for j in others)[-room:]
            want = chunk_kv_in_stream(engine, context, [ids[j] for j in members])
            last = keys[members[-1]]
            second = engine.variants.index.keys(last)[1]
            got = engine.store.get(second, ids[members[-1]])
            torch.testing.assert_close(got.k, want.k, rtol=1e-5, atol=1e-5)
            assert got.meta["context"] != stored(engine, docs[members[-1]]).meta["context"]
        again = engine.warm(docs)
        assert (again.computed, again.cached, again.variants) == (0, 4, 0)
        # the contexts the warm names before computing are the ones its records carry
        cc = engine.chunk_computer
        got = cc.compute_window([ids[2], ids[3]], [ids[0], ids[1]], context_tokens=room)
        named = cc.window_contexts([ids[2], ids[3]], [ids[0], ids[1]], context_tokens=room)
        assert [tuple(r.meta["context"]) for r in got] == named
        with pytest.raises(InvalidRequestError, match="warm_variants"):
            engine.config.replace(warm_variants=2, max_variants=1)
        with pytest.raises(InvalidRequestError, match="warm_variants"):
            engine.config.replace(warm_variants=3)
    finally:
        engine.close()


def test_default_warm_variants_follow_the_order(tiny_model, tiny_tokenizer, docs):
    """By default a corpus warmed by similarity gets two variants per chunk, a given list one; with
    max_variants=1 the default asks for no second one (and is no error)."""
    for order, settings, want in (("similar", {}, 4), ("given", {}, 0), ("similar", {"max_variants": 1}, 0)):
        with Engine.from_model(
            tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=2), **settings
        ) as engine:
            assert engine.config.warm_variants is None
            res = engine.warm(docs, order=order)
            assert (res.computed, res.variants) == (4, want), (order, settings)


def test_second_variants_take_no_room_from_first_ones(tiny_model, tiny_tokenizer, docs):
    """In a store that holds the list once, the reverse pass keeps nothing: its variants are kept
    ahead of need and never push out a chunk's first variant (the hit rate of one variant stays)."""
    with Engine.from_model(
        tiny_model, tiny_tokenizer, sampling=SamplingParams(max_new_tokens=2), warm_variants=1
    ) as probe:
        probe.warm(docs)
        held = probe.store.stats()["bytes"]
    with Engine.from_model(
        tiny_model,
        tiny_tokenizer,
        sampling=SamplingParams(max_new_tokens=2),
        warm_variants=2,
        memory_budget_bytes=held + 64,
    ) as engine:
        res = engine.warm(docs)
        assert (res.computed, res.variants) == (4, 4)  # computed, then refused
        keys = [engine.planner.chunk_key(engine.prompt_tokenizer.tokenize(d)) for d in docs]
        assert all(engine.store.contains(k) for k in keys)
        assert all(engine.variants.index.keys(k) == [k] for k in keys)
        assert engine.store.stats()["speculative_refused"] == 4


def test_default_warm_window_keeps_the_full_context(tiny_engine):
    cc = tiny_engine.chunk_computer
    assert tiny_engine.config.warm_window_tokens == 4096
    assert cc.window_context_tokens(4096) == cc.context_tokens  # the bound (<= 1536, 3/8 of 4096): unchanged
    for bad in (100, 1024.0, True):
        with pytest.raises(InvalidRequestError, match="warm_window_tokens"):
            tiny_engine.config.replace(warm_window_tokens=bad)


def test_sink_context_computes_each_chunk_alone(tiny_model, tiny_tokenizer, docs):
    engine = Engine.from_model(tiny_model, tiny_tokenizer, chunk_context="sink")
    try:
        assert engine.warm(docs).computed == len(docs)
        ids = engine.prompt_tokenizer.tokenize(docs[1])
        want = chunk_kv_in_stream(engine, [engine.tokenizer.bos_token_id], [ids])
        torch.testing.assert_close(stored(engine, docs[1]).k, want.k, rtol=1e-5, atol=1e-5)
    finally:
        engine.close()


def test_write_back_makes_misses_hits(tiny_engine, docs):
    tiny_engine.generate(docs[:2], PREFIX, SUFFIX)
    tiny_engine.flush()
    g = tiny_engine.generate(docs[:2], PREFIX, SUFFIX)
    assert g.stats.chunk_hits == 2


def test_a_request_with_nothing_cached_runs_full_and_still_writes_back(tiny_engine, docs):
    g = tiny_engine.generate(docs[:3], PREFIX, SUFFIX)  # blend asked (the default), the store empty
    assert (g.stats.mode, g.stats.path, g.stats.path_reason) == ("blend", "full", "nothing cached")
    assert g.stats.chunks_found == g.stats.cached_tokens == g.stats.recomputed_tokens == 0
    assert g.stats.compute_fraction == 1.0
    assert g.token_ids == tiny_engine.generate(docs[:3], PREFIX, SUFFIX, mode="full").token_ids
    tiny_engine.flush()
    # what it computed was kept (mode="full" keeps nothing): the next request finds every chunk
    assert tiny_engine.lookup(docs[:3], PREFIX, SUFFIX).chunks_stored == 3
    again = tiny_engine.generate(docs[:3], PREFIX, SUFFIX)
    assert again.stats.chunks_found == 3 and again.stats.path != "full"
    assert again.stats.cached_tokens > 0


def test_reuse_mode_computes_only_uncached_tokens(family_engine, docs):
    family_engine.warm(docs)
    g = family_engine.generate(docs, PREFIX, SUFFIX, mode="reuse")
    assert g.stats.recomputed_tokens == 0
    assert g.stats.computed_tokens == g.stats.prompt_tokens - g.stats.cached_tokens


def test_no_chunks_is_plain_generation(family_engine):
    prompt = "the king was born in"
    g = family_engine.generate(prefix=prompt, max_new_tokens=10)
    ids = family_engine.tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        ref = family_engine.hf_model.generate(
            ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert g.token_ids == ref[0, ids.shape[1] :].tolist()[: len(g.token_ids)]
    assert g.stats.chunk_hits == g.stats.chunk_misses == 0


def test_exact_prefix_reuse_is_exact(family_engine, docs):
    first = family_engine.generate(docs, PREFIX, SUFFIX, mode="prefix", max_new_tokens=10)
    family_engine.flush()
    second = family_engine.generate(docs, PREFIX, SUFFIX, mode="prefix", max_new_tokens=10)
    full = family_engine.generate(docs, PREFIX, SUFFIX, mode="full", max_new_tokens=10)
    assert first.stats.prefix_tokens == 0
    # the prefix up to the last chunk, the tail after it (with the last hidden state): nothing computed
    assert second.stats.prefix_tokens >= family_engine.count_tokens(PREFIX) + sum(map(family_engine.count_tokens, docs))
    assert second.stats.exact_tokens == second.stats.prompt_tokens and second.stats.computed_tokens == 0
    assert second.token_ids == full.token_ids == first.token_ids
    torch.testing.assert_close(
        last_logits(family_engine, docs, "prefix"), last_logits(family_engine, docs, "full"), rtol=1e-4, atol=1e-4
    )


def test_system_prompt_is_reused_across_requests(tiny_engine):
    a, b = make_docs(2, seed=1), make_docs(2, seed=2)
    tiny_engine.generate(a, PREFIX, SUFFIX)
    tiny_engine.flush()
    g = tiny_engine.generate(b, PREFIX, SUFFIX)
    assert g.stats.prefix_tokens == tiny_engine.count_tokens(PREFIX)  # partial last block included


def test_stream_pieces_make_the_text(tiny_engine, docs):
    s = tiny_engine.stream(docs, PREFIX, SUFFIX, max_new_tokens=12)
    pieces = list(s)
    assert "".join(pieces) == s.generation.text
    assert s.generation.stats.completion_tokens == len(s.generation.token_ids) <= 12


def test_stop_strings_and_max_tokens(tiny_engine, docs):
    g = tiny_engine.generate(docs, PREFIX, SUFFIX, mode="full", max_new_tokens=20)
    assert g.finish_reason == "length" and len(g.token_ids) == 20
    word = g.text.strip().split()[1] if len(g.text.split()) > 1 else g.text[1:3]
    cut = tiny_engine.generate(docs, PREFIX, SUFFIX, mode="full", max_new_tokens=20, stop=[word])
    assert cut.finish_reason == "stop"
    assert word not in cut.text and g.text.startswith(cut.text)
    none = tiny_engine.generate(docs, PREFIX, SUFFIX, max_new_tokens=0)
    assert none.text == "" and none.token_ids == []


def test_sampling_is_seeded(tiny_engine, docs):
    a = tiny_engine.generate(docs, PREFIX, SUFFIX, mode="full", temperature=1.0, seed=7, max_new_tokens=10)
    b = tiny_engine.generate(docs, PREFIX, SUFFIX, mode="full", temperature=1.0, seed=7, max_new_tokens=10)
    assert a.token_ids == b.token_ids
    c = tiny_engine.generate(docs, PREFIX, SUFFIX, temperature=1.0, top_p=0.5, seed=3, max_new_tokens=10)
    assert len(c.token_ids) == 10


def test_sampling_params_are_the_keywords_as_one_object(tiny_engine, docs):
    by_keywords = tiny_engine.generate(docs, PREFIX, SUFFIX, temperature=1.0, seed=5, max_new_tokens=6, stop="zzz")
    params = SamplingParams(temperature=1.0, seed=5, max_new_tokens=6, stop="zzz")
    by_object = tiny_engine.generate(docs, PREFIX, SUFFIX, sampling=params)
    assert by_object.token_ids == by_keywords.token_ids and len(by_object.token_ids) == 6
    # unset fields come from the engine config (max_new_tokens=8 in the fixture)
    assert len(tiny_engine.generate(docs, PREFIX, SUFFIX, sampling=SamplingParams(), mode="full").token_ids) <= 8
    with pytest.raises(InvalidRequestError, match="not both"):
        tiny_engine.generate(docs, PREFIX, SUFFIX, sampling=params, temperature=0.0)
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        tiny_engine.generate(docs, PREFIX, SUFFIX, sampling={"temperature": 0.0})


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(max_new_tokens=2.5), "max_new_tokens"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(stop=["ok", 3]), "stop"),
        (dict(seed="7"), "seed"),
    ],
)
def test_bad_sampling_params_name_the_field(fields, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**fields)


def test_tenants_never_see_each_others_cache(tiny_engine, docs):
    tiny_engine.warm(docs, namespace="tenant-a")
    a = tiny_engine.generate(docs, PREFIX, SUFFIX, namespace="tenant-a", max_new_tokens=1)
    b = tiny_engine.generate(docs, PREFIX, SUFFIX, namespace="tenant-b", max_new_tokens=1)
    assert a.stats.chunk_hits == len(docs) and b.stats.chunk_hits == 0
    tiny_engine.flush()  # b's misses are written back under b: b hits next time, the default tenant does not
    again = tiny_engine.generate(docs, PREFIX, SUFFIX, namespace="tenant-b", max_new_tokens=1)
    assert again.stats.chunk_hits == len(docs)
    plain = tiny_engine.generate(docs, PREFIX, SUFFIX, max_new_tokens=1)
    assert plain.stats.chunk_hits == 0 and plain.stats.prefix_tokens == 0
    tiny_engine.generate(prompt=PREFIX + SUFFIX, conversation_id="c", namespace="tenant-a", max_new_tokens=2)
    assert not tiny_engine.end_conversation("c") and tiny_engine.end_conversation("c", namespace="tenant-a")
    with pytest.raises(InvalidRequestError, match="namespace"):
        tiny_engine.generate(docs, PREFIX, SUFFIX, namespace="")


def test_unknown_request_arguments_are_named(tiny_engine):
    with pytest.raises(InvalidRequestError, match="recompute_rato"):
        tiny_engine.generate(["a document"], PREFIX, SUFFIX, recompute_rato=0.2)


def test_score_matches_generation_logits(tiny_engine, docs):
    g = tiny_engine.generate(docs, PREFIX, SUFFIX, mode="full", max_new_tokens=6)
    s = tiny_engine.score(g.text, docs, PREFIX, SUFFIX, mode="full")
    assert s.tokens == len(tiny_engine.tokenizer(g.text, add_special_tokens=False)["input_ids"])
    assert s.logprob < 0 and len(s.token_logprobs) == s.tokens


def test_concurrent_callers_get_the_same_answers(tiny_engine):
    requests = [make_docs(3, seed=s) for s in range(4)]
    expected = [tiny_engine.generate(r, PREFIX, SUFFIX, mode="full").token_ids for r in requests]
    results: dict[int, list[int]] = {}
    errors = []

    def run(i):
        try:
            results[i] = tiny_engine.generate(requests[i], PREFIX, SUFFIX, mode="full").token_ids
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [results[i] for i in range(4)] == expected


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mode="fast"), "unknown mode"),
        (dict(recompute_ratio=1.5), r"\[0, 1\]"),
        (dict(recompute_ratio=-0.1), r"\[0, 1\]"),
        (dict(chunks=["ok", 3]), "chunk 1 is int"),
        (dict(chunks="just one string"), "list of strings"),
        (dict(prefix=None, suffix=b"bytes"), "suffix must be a string"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(stop=[1]), "stop"),
    ],
)
def test_bad_requests_are_refused_clearly(tiny_engine, kwargs, match):
    args = dict(chunks=["a document"], prefix=PREFIX, suffix=SUFFIX)
    args.update(kwargs)
    with pytest.raises(InvalidRequestError, match=match):
        tiny_engine.generate(**args)


def test_empty_prompt_is_refused(tiny_engine):
    with pytest.raises(InvalidRequestError, match="empty"):
        tiny_engine.generate()
    with pytest.raises(InvalidRequestError, match="empty"):
        tiny_engine.generate(chunks=["", ""])


def test_prompt_beyond_the_context_window(tiny_engine):
    long_doc = " ".join(["river"] * 1500)
    with pytest.raises(ContextLengthError) as err:
        tiny_engine.generate([long_doc], PREFIX, SUFFIX)
    assert err.value.limit == tiny_engine.context_window == 1024
    assert "1024" in str(err.value)
    # the engine still works afterwards
    assert tiny_engine.generate(["short"], PREFIX, SUFFIX).stats.prompt_tokens > 0


def test_generation_stops_at_the_context_window(tiny_model, tiny_tokenizer):
    engine = Engine.from_model(tiny_model, tiny_tokenizer, max_context=64)
    g = engine.generate(prefix="river " * 55, max_new_tokens=50)
    assert g.finish_reason == "length"
    assert g.stats.prompt_tokens + len(g.token_ids) <= 64


def test_closed_engine_refuses(tiny_model, tiny_tokenizer):
    engine = Engine.from_model(tiny_model, tiny_tokenizer)
    engine.close()
    with pytest.raises(InvalidRequestError, match="closed"):
        engine.generate(prefix="hello")


def test_a_device_the_weights_are_not_on_is_refused(tiny_model, tiny_tokenizer):
    # the engine computes where the weights are: a CPU model asked to run on CUDA would run on the CPU
    with pytest.raises(InvalidRequestError, match="move the model first"):
        Engine.from_model(tiny_model, tiny_tokenizer, device="cuda")


def test_prompt_string_is_split_at_registered_documents(tiny_engine, docs):
    tiny_engine.register(docs)
    tiny_engine.warm(docs)
    prompt = PREFIX + "".join(f"[{i}] {d}\n" for i, d in enumerate(reversed(docs))) + SUFFIX
    parts = tiny_engine.split_prompt(prompt)
    assert [t for k, t in parts if k == "chunk"] == list(reversed(docs))
    assert "".join(t for _, t in parts) == prompt
    g = tiny_engine.generate(prompt=prompt)
    assert g.stats.chunk_hits == len(docs)
    # the same prompt in full mode is the same segment tokenization, computed whole
    full = tiny_engine.generate(prompt=prompt, mode="full")
    assert full.stats.prompt_tokens == g.stats.prompt_tokens
    with pytest.raises(InvalidRequestError, match="either prompt"):
        tiny_engine.generate(docs, prompt=prompt)


def test_lookup_counts_what_a_request_would_find_and_changes_nothing(tiny_engine, docs):
    cold = tiny_engine.lookup(docs[:2], PREFIX, SUFFIX)
    assert (cold.chunks, cold.chunks_stored, cold.chunk_tokens_stored) == (2, 0, 0)
    tiny_engine.warm(docs[:1])
    tiny_engine.flush()
    before = tiny_engine.store.stats()
    found = tiny_engine.lookup(docs[:2], PREFIX, SUFFIX)
    assert tiny_engine.store.stats() == before  # key lookups only: no hit, no load counted
    assert (found.chunks, found.chunks_stored) == (2, 1)
    g = tiny_engine.generate(docs[:2], PREFIX, SUFFIX)
    assert g.stats.chunk_hits == 1
    assert found.chunk_tokens_stored == g.stats.chunks[0].tokens
    assert found.prompt_tokens == g.stats.prompt_tokens
    assert found.cached_tokens == g.stats.cached_tokens
    with pytest.raises(InvalidRequestError):
        tiny_engine.lookup([], "", "")


def test_a_request_that_finds_no_chunk_kv_computes_what_full_computes(tiny_engine, docs):
    # the bench records drift 0 without scoring such a request (benchmarks.retrieval): this is why
    cont = " the answer is here"
    ref = tiny_engine.score(cont, docs[:2], PREFIX, SUFFIX, mode="full")
    tiny_engine.generate(docs[2:3], PREFIX, SUFFIX)  # the prefix (system text) cached, docs[2] written back
    tiny_engine.flush()
    found = tiny_engine.lookup(docs[:2], PREFIX, SUFFIX)
    assert found.chunks_stored == 0 and found.prefix_tokens > 0
    got = tiny_engine.score(cont, docs[:2], PREFIX, SUFFIX)
    assert got.stats.prefix_tokens > 0 and got.stats.chunk_hits == 0
    assert got.token_logprobs == ref.token_logprobs
