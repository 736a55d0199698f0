"""Real-bytes backends: round trips through tiers and stores, flipped bytes detected, slots reused, O_DIRECT.

Flipping a byte needs to know where a block lives: `_where[key]` (slot, length, checksum) and the memory backend's
`_slab` are private, read here only to aim the corruption.
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest

from kvscope.tierstore.backends import (
    DIRECT_IO_ALIGNMENT,
    Backend,
    CorruptBlockError,
    FileBackend,
    MemoryBackend,
    make_backend,
)
from kvscope.tierstore.policies import make_policy
from kvscope.tierstore.store import TieredStore, synthetic_payload
from kvscope.tierstore.tier import Tier

BLOCK = 100


def slot_offset(backend, key) -> int:
    slot, _length, _checksum = backend._where[key]
    return slot * backend.slot_bytes


def flip_byte(backend, key, at: int = 7) -> None:
    """Invert one byte of `key`'s stored bytes behind the backend's back (slab or file on disk)."""
    offset = slot_offset(backend, key) + at
    if isinstance(backend, MemoryBackend):
        backend._slab[offset] ^= 0xFF
        return
    fd = os.open(backend.path, os.O_RDWR)
    try:
        (old,) = os.pread(fd, 1, offset)
        assert os.pwrite(fd, bytes([old ^ 0xFF]), offset) == 1
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.fixture(params=["memory", "file"])
def backend_kind(request):
    return request.param


@pytest.fixture
def new_backend(backend_kind, tmp_path):
    """Factory for a backend of the parametrized kind with `blocks` slots of BLOCK bytes."""

    def make(blocks: int, name: str = "tier") -> Backend:
        return make_backend(backend_kind, blocks * BLOCK, BLOCK, tmp_path / f"{name}.blocks")

    return make


def test_synthetic_payload_is_the_key_digest_repeated():
    """100 B = three 32-byte BLAKE2b digests of repr(key) and the first 4 bytes of a fourth."""
    digest = hashlib.blake2b(repr("k0").encode(), digest_size=32).digest()
    assert synthetic_payload("k0", 100) == digest * 3 + digest[:4]
    assert synthetic_payload("k0", 0) == b""
    assert synthetic_payload("k1", 100) != synthetic_payload("k0", 100)


def test_round_trip_through_a_store(new_backend):
    """Bytes read back are exactly the bytes put (synthetic payload of each key)."""
    backend = new_backend(4)
    tier = Tier("dram", 4 * BLOCK, make_policy("lru"), backend)
    store = TieredStore([tier])
    keys = ["k0", "k1", "k2"]
    assert store.put(keys, BLOCK) == 3 * BLOCK
    assert store.read_prefix(keys).read_bytes == [3 * BLOCK]  # verifies every block
    assert [tier.backend.load(key) for key in keys] == [synthetic_payload(key, BLOCK) for key in keys]
    # payloads differ per key: a misdirected read could not pass its check
    assert len({tier.backend.load(key) for key in keys}) == 3
    store.close()


def test_flipped_byte_is_detected_on_load(new_backend):
    """One inverted byte in the slab / on disk: loading through the store raises CorruptBlockError."""
    backend = new_backend(4)
    store = TieredStore([Tier("dram", 4 * BLOCK, make_policy("lru"), backend)])
    keys = ["k0", "k1"]
    store.put(keys, BLOCK)
    flip_byte(backend, "k1", at=BLOCK - 1)
    assert backend.load("k0") == synthetic_payload("k0", BLOCK)
    with pytest.raises(CorruptBlockError, match="k1"):
        store.read_prefix(keys)
    store.close()


def test_slots_are_reused_after_drop(new_backend):
    """A full backend refuses a new block; after a drop the freed slot takes it without disturbing others."""
    backend = new_backend(2)
    backend.store("a", b"A" * BLOCK)
    backend.store("b", b"B" * 50)
    with pytest.raises(MemoryError, match="2 slots"):
        backend.store("c", b"C" * BLOCK)
    freed = slot_offset(backend, "a")
    backend.drop("a")
    backend.store("c", b"C" * 30)
    assert slot_offset(backend, "c") == freed
    assert backend.load("b") == b"B" * 50
    assert backend.load("c") == b"C" * 30
    with pytest.raises(KeyError):
        backend.load("a")
    backend.close()


def test_evicting_tier_recycles_its_slots(new_backend):
    """A 2-block tier on a 2-slot backend absorbs 10 writes: evictions must drop their slots."""
    backend = new_backend(2)
    tier = Tier("dram", 2 * BLOCK, make_policy("fifo"), backend)
    for index in range(10):
        tier.write([f"k{index}"], BLOCK, synthetic_payload, is_put=True)
    assert tier.counters.evictions == 8
    assert tier.read_run(["k8", "k9"], 0, 2) == (2, 2 * BLOCK)
    assert [tier.backend.load(k) for k in ("k8", "k9")] == [synthetic_payload(k, BLOCK) for k in ("k8", "k9")]
    backend.close()


def test_demotion_and_promotion_carry_the_real_bytes(backend_kind, tmp_path):
    """memory dram (1 block) over a memory/file nof: a is demoted, then promoted back, bytes intact."""
    dram = Tier("dram", BLOCK, make_policy("lru"), MemoryBackend(BLOCK, BLOCK))
    nof_backend = make_backend(backend_kind, 4 * BLOCK, BLOCK, tmp_path / "nof.blocks")
    nof = Tier("nof", 4 * BLOCK, make_policy("lru"), nof_backend)
    store = TieredStore([dram, nof], "demote", promote_on_hit=True)
    store.put(["a"], BLOCK)
    store.put(["b"], BLOCK)  # a goes down to nof with its bytes
    assert nof_backend.load("a") == synthetic_payload("a", BLOCK)
    assert store.read_prefix(["a"]).read_bytes == [0, BLOCK]  # served by nof, then moved up
    assert "a" in dram and "a" not in nof
    assert dram.read_run(["a"], 0, 1) == (1, BLOCK)
    assert dram.backend.load("a") == synthetic_payload("a", BLOCK)
    assert nof.read_run(["b"], 0, 1) == (1, BLOCK)
    assert nof.backend.load("b") == synthetic_payload("b", BLOCK)
    store.close()


def test_real_bytes_tier_needs_a_payload_and_a_fitting_slot():
    tier = Tier("dram", 2 * BLOCK, make_policy("lru"), MemoryBackend(2 * BLOCK, BLOCK))
    with pytest.raises(ValueError, match="needs a payload source"):
        tier.write(["a"], BLOCK, None, is_put=True)
    backend = MemoryBackend(2 * BLOCK, BLOCK)
    with pytest.raises(ValueError, match=f"block of {BLOCK + 1} B does not fit a {BLOCK} B slot"):
        backend.store("big", b"x" * (BLOCK + 1))


def test_make_backend_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="needs a path"):
        make_backend("file", 4 * BLOCK, BLOCK)
    with pytest.raises(ValueError, match="accounting, memory, file"):
        make_backend("nvme", 4 * BLOCK, BLOCK)
    assert make_backend("accounting", 4 * BLOCK, BLOCK).holds_bytes is False


@pytest.mark.parametrize("direct", [False, True])
def test_file_reads_survive_dropping_the_page_cache(tmp_path, direct):
    """A cold read (pages dropped, through the read mapping too) comes back from the file, still checked."""
    backend = FileBackend(4 * DIRECT_IO_ALIGNMENT, DIRECT_IO_ALIGNMENT, tmp_path / "tier.blocks", direct=direct)
    backend.store("a", synthetic_payload("a", DIRECT_IO_ALIGNMENT))
    backend.verify("a")
    backend.drop_page_cache()
    assert backend.load("a") == synthetic_payload("a", DIRECT_IO_ALIGNMENT)
    flip_byte(backend, "a")
    backend.drop_page_cache()
    with pytest.raises(CorruptBlockError, match="'a'"):
        backend.verify("a")
    backend.close()


def test_truncated_file_is_an_error_not_a_crash(tmp_path):
    """Reading mapped pages past the end of a truncated file would kill the process: the read says what happened."""
    path = tmp_path / "tier.blocks"
    backend = FileBackend(4 * BLOCK, BLOCK, path)
    backend.store("a", synthetic_payload("a", BLOCK))
    os.truncate(path, BLOCK // 2)
    with pytest.raises(OSError, match=f"{path} was truncated below its {4 * BLOCK} B"):
        backend.verify("a")
    backend.close()


# --------------------------------------------------------------------------- O_DIRECT


def test_o_direct_rejects_unaligned_slot_size(tmp_path):
    """O_DIRECT I/O must be 4 KiB aligned: a 1000 B slot is refused before any file is opened."""
    path = tmp_path / "direct.blocks"
    with pytest.raises(ValueError, match=f"multiple of {DIRECT_IO_ALIGNMENT} B: 1000"):
        FileBackend(4000, 1000, path, direct=True)
    assert not path.exists()


@pytest.mark.parametrize("direct", [False, True])
def test_open_failure_names_the_file(tmp_path, direct):
    """A file backend that cannot open its file says which file, and whether O_DIRECT was asked for."""
    path = tmp_path / "no-such-dir" / "tier.blocks"
    with pytest.raises(OSError, match=f"cannot open file backend {path} \\(o_direct={direct}\\)"):
        FileBackend(4 * DIRECT_IO_ALIGNMENT, DIRECT_IO_ALIGNMENT, path, direct=direct)


@pytest.mark.parametrize("where", ["tmp_path", "/dev/shm"])
def test_o_direct_round_trip_or_error_naming_the_path(where, tmp_path):
    """Try O_DIRECT for real: it round-trips and catches a flipped byte, or the refusal names the file."""
    directory = tmp_path if where == "tmp_path" else Path(where)
    if not directory.is_dir():
        pytest.fail(f"{directory} does not exist on this host")
    path = directory / f"kvscope-test-{os.getpid()}-{tmp_path.name}.blocks"
    slot = DIRECT_IO_ALIGNMENT
    try:
        try:
            backend = FileBackend(4 * slot, slot, path, direct=True)
            backend.store("short", b"s" * 1000)
            backend.store("full", synthetic_payload("full", slot))
            assert backend.load("short") == b"s" * 1000
            assert backend.load("full") == synthetic_payload("full", slot)
        except OSError as error:
            assert error.errno in (None, errno.EINVAL), error
            assert str(path) in str(error), f"O_DIRECT refusal does not name the file: {error}"
            return
        flip_byte(backend, "full", at=slot - 1)
        with pytest.raises(CorruptBlockError, match="'full'"):
            backend.load("full")
        assert backend.load("short") == b"s" * 1000
        backend.close()
    finally:
        path.unlink(missing_ok=True)
