from kvrag.engine.reuse.documents import DocumentFinder, content_id


def test_finds_texts_anywhere_in_any_order():
    reg = DocumentFinder(min_chars=8, anchor=8)
    a, b, c = "alpha document text here", "beta document, other words", "gamma is not in the prompt"
    reg.register([a, b, c])
    prompt = f"System: use docs.\nDoc 1: {b}\n---\nDoc 2: {a}\nQuestion?"
    parts = reg.split(prompt)
    assert [t for k, t in parts if k == "chunk"] == [b, a]
    assert "".join(t for _, t in parts) == prompt


def test_longest_match_wins_and_no_overlap():
    reg = DocumentFinder(min_chars=8, anchor=8)
    short, long = "shared beginning", "shared beginning and a longer tail"
    reg.register([short, long])
    spans = reg.find("x " + long + " " + short)
    assert spans == [(2, 2 + len(long)), (3 + len(long), 3 + len(long) + len(short))]


def test_short_texts_ignored_and_bounded():
    reg = DocumentFinder(max_entries=2, min_chars=8, anchor=8)
    ids = reg.register(["tiny", "first long text", "second long text", "third long text"])
    assert ids[0] == content_id("tiny")
    assert len(reg) == 2
    assert "first long text" not in reg and "third long text" in reg
    assert reg.find("first long text") == []


def test_texts_alike_for_long_prefixes_split_as_a_plain_search_would():
    import random

    rng = random.Random(3)
    reg = DocumentFinder(min_chars=8, anchor=8)
    stem = "the same opening words of every text "
    texts = sorted(
        {stem[: rng.randrange(8, len(stem))] + "".join(rng.choices("ab ", k=rng.randrange(0, 90))) for _ in range(400)}
    )
    reg.register(texts)
    kept = [t for t in texts if reg.holds(t)]
    for _ in range(30):
        prompt = " | ".join(rng.choice(kept) for _ in range(3))
        i, spans = 0, []
        while i < len(prompt):  # the reference: leftmost, then longest, non-overlapping
            best = max((len(t) for t in kept if prompt.startswith(t, i)), default=0)
            if best:
                spans.append((i, i + best))
            i += best or 1
        assert reg.find(prompt) == spans
