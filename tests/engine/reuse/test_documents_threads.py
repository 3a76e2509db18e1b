"""The chunk registry under concurrent registration and lookup (integrations register from many threads)."""

from __future__ import annotations

import random
import sys
import threading

from kvrag.engine.reuse.documents import DocumentFinder


def _text(rng: random.Random, head: str, words: int = 40) -> str:
    return head + " ".join(rng.choice(("red", "blue", "green", "stone", "river", "tower")) for _ in range(words))


def test_concurrent_register_and_split_agree_with_a_quiet_split():
    """Writers churn the registry (texts sharing the prompt's passages' anchors, and evictions)
    while readers split the same prompt: no exception, and every split equals the quiet one."""
    rng = random.Random(0)
    reg = DocumentFinder(max_entries=60, min_chars=16, anchor=16)
    docs = [_text(rng, f"document number {i}: ") for i in range(5)]
    reg.register(docs)
    prompt = "system: answer.\n" + "\n--\n".join(docs[::-1]) + "\nquestion: which tower?"
    expected = reg.split(prompt)
    assert [t for k, t in expected if k == "chunk"] == docs[::-1]

    errors: list[BaseException] = []
    results: list[list[tuple[str, str]]] = []
    stop = threading.Event()

    def writer(seed: int) -> None:
        wrng = random.Random(seed)
        try:
            for round_ in range(400):
                # same first 16 characters as a prompt document (its anchor bucket is replaced while
                # readers look it up), then text the prompt does not contain; the prompt's documents
                # are registered again first, so the evictions (60 entries) take only these
                variants = [d[:16] + f"variant {seed}.{round_}.{j} " + _text(wrng, "") for j, d in enumerate(docs)]
                reg.register(docs + variants)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    def reader() -> None:
        try:
            while not stop.is_set():
                results.append(reg.split(prompt))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    writers = [threading.Thread(target=writer, args=(s,)) for s in range(3)]
    readers = [threading.Thread(target=reader) for _ in range(3)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: interleave finely
    try:
        for t in readers + writers:
            t.start()
        for t in writers:
            t.join()
    finally:
        stop.set()
        for t in readers:
            t.join()
        sys.setswitchinterval(interval)

    assert errors == []
    assert results and all(r == expected for r in results)
    assert len(reg) == 60  # bounded throughout, the prompt's documents kept
    assert all(d in reg for d in docs)
