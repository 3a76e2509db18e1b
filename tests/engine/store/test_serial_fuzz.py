"""Fuzzing the store decoder: damaged entries are a miss or a verified hit, never an error, never
a wrong tensor.

Entries are encoded, then damaged at random (:func:`tests.engine.store.helpers.damage`: truncated,
extended, bits flipped, byte ranges overwritten, a header spliced onto another entry's body,
random bytes behind a valid magic) and read back through :mod:`kvrag.engine.store.serial` and through the disk tier.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrag.engine.store import serial
from kvrag.engine.store.base import DamagedEntryError
from kvrag.engine.store.disk import DiskStore
from tests.engine.store.helpers import DAMAGE, damage, entry_path, key, record, same, token_ids

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _entry(i: int, dtype: torch.dtype, stats: bool) -> bytes:
    return serial.encode(key(i, tokens=6), record(i, tokens=6, layers=3, heads=2, dim=4, stats=stats), dtype)


@st.composite
def damaged(draw):
    """(original record number, stats?, damaged bytes)."""
    i, stats, dtype = draw(st.integers(0, 3)), draw(st.booleans()), draw(st.sampled_from(_DTYPES))
    how, rng = draw(st.sampled_from(DAMAGE)), draw(st.randoms(use_true_random=False))
    return i, stats, damage(_entry(i, dtype, stats), how, rng, other=_entry(i + 1, dtype, stats))


def _decode(path) -> object:
    """What a reader gets: the record, or None for a miss (DamagedEntryError)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        h = serial.read_header(fd, os.fstat(fd).st_size)
        return serial.read_record(fd, h, serial.read_tokens(fd, h))
    except DamagedEntryError:
        return None
    finally:
        os.close(fd)


@given(damaged())
def test_a_damaged_entry_is_a_miss_or_the_exact_record(tmp_path_factory, case):
    i, stats, blob = case
    path = tmp_path_factory.mktemp("entry") / "e.kv"
    path.write_bytes(blob)
    got = _decode(path)  # any other exception fails the test
    if got is not None:  # damage that missed every checksummed byte (header padding): the same data
        want = record(i, tokens=6, layers=3, heads=2, dim=4, stats=stats)
        assert same(got, want) and got.stats.keys() == want.stats.keys()
        assert all(torch.equal(got.stats[n].float(), want.stats[n].float()) for n in want.stats)


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    store = DiskStore(tmp_path_factory.mktemp("disk"), 1 << 26, dtype="float32")
    yield store
    store.close()


@settings(max_examples=40)
@given(damaged())
def test_the_disk_tier_serves_damaged_entries_as_misses(disk, case):
    i, stats, blob = case
    k = key(i, tokens=6)
    want = record(i, tokens=6, layers=3, heads=2, dim=4, stats=stats)
    assert disk.put(k, want)
    with open(entry_path(disk, k), "wb") as f:  # the damage happens on disk, behind the index's back
        f.write(blob)
    got = disk.get(k, token_ids(i, 6))  # never raises
    assert got is None or same(got, want)
    if got is None:
        assert not disk.contains(k)  # dropped, so that it is recomputed


def test_a_valid_entry_of_another_key_is_a_miss(disk):
    """A whole, valid entry moved under another key's name (a misplaced file) is not served."""
    k = key(7, tokens=6)
    assert disk.put(k, record(7, tokens=6, layers=3, heads=2, dim=4))
    with open(entry_path(disk, k), "wb") as f:
        f.write(_entry(8, torch.float32, False))
    assert disk.get(k, token_ids(7, 6)) is None and disk.get(k) is None
