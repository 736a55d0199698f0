"""Chained prefix-cache block keys, compatible with vLLM (v1), plus a cheap integer chain.

Why: a tier store only finds a prefix again if it names blocks the way the engine does. vLLM keys a
*full* block ``k`` by ``H((key[k-1], tuple(block_k_token_ids), extra_keys_k))``, where ``key[-1]`` is a
per-deployment seed (``NONE_HASH``) and ``extra_keys`` is ``None`` or a tuple (LoRA name, multimodal
``(identifier, offset)`` pairs, cache salt on block 0, prompt-embeds digest, in that order). A partial
trailing block never gets a key. ``H`` is chosen by ``--prefix-caching-hash-algo``:

- ``sha256`` (the default): SHA-256 (32 bytes) of ``pickle.dumps(tuple, HIGHEST_PROTOCOL)``;
- ``sha256_cbor``: SHA-256 of canonical CBOR (``cbor2.dumps(tuple, canonical=True)``);
- ``xxhash`` / ``xxhash_cbor``: XXH3-128 (16 bytes) of the same pickle / CBOR bytes.

This module is an independent implementation of that scheme (no vLLM code); canonical CBOR comes from
``cbor2``, as in vLLM. The ``xxhash*`` algorithms need the optional ``xxhash`` package, as in vLLM.

Pickle caveats (``sha256``/``xxhash``): keys match vLLM on the same CPython (HIGHEST_PROTOCOL is 5 on
3.8-3.13). Pass tokens as ints and extra keys with the exact Python types vLLM uses (tuples, not
lists), because pickle encodes types; and pickle back-references repeated *identical* str/bytes
objects inside one tuple, in vLLM too, so two equal string extra keys in one block depend on object
identity. CBOR has none of these issues.

For simulations that never compare against a live vLLM, ``integer_chain_keys`` gives the same
chaining semantics at ~0.3 us per block.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Final, Literal

import cbor2

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGO",
    "INT_CHAIN_ROOT",
    "BlockHasher",
    "HashAlgo",
    "as_event_int",
    "integer_chain_key",
    "integer_chain_keys",
    "none_hash",
    "none_hash_from_env",
    "random_none_hash",
]

HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
ALGORITHMS: Final[tuple[str, ...]] = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_ALGO: Final[str] = "sha256"  # vLLM's CacheConfig.prefix_caching_hash_algo default
RANDOM_ROOT_BYTES: Final[int] = 32  # vLLM draws os.urandom(32) when PYTHONHASHSEED is unset
INT_CHAIN_ROOT: Final[int] = 0  # parent of the first block for integer_chain_keys

# --------------------------------------------------------------------------- serialization


def _pickle_bytes(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor_bytes(obj: Any) -> bytes:
    return cbor2.dumps(obj, canonical=True)


# --------------------------------------------------------------------------- digests


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    try:
        import xxhash
    except ImportError:
        raise ModuleNotFoundError(
            "the 'xxhash' / 'xxhash_cbor' prefix-caching algorithms need the optional xxhash package"
        ) from None
    return xxhash.xxh3_128_digest(data)


_ALGOS: Final[dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], bytes]]]] = {
    "sha256": (_pickle_bytes, _sha256),
    "sha256_cbor": (_cbor_bytes, _sha256),
    "xxhash": (_pickle_bytes, _xxh3_128),
    "xxhash_cbor": (_cbor_bytes, _xxh3_128),
}


def _hash_fn(algo: str) -> Callable[[Any], bytes]:
    """Object -> digest for a vLLM ``--prefix-caching-hash-algo`` name; ValueError names bad input."""
    try:
        encode, digest = _ALGOS[algo]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown prefix-caching hash algorithm {algo!r}; expected one of {', '.join(ALGORITHMS)}"
        ) from None
    if digest is _xxh3_128:
        _xxh3_128(b"")  # fail at construction, not mid-chain, when xxhash is missing

    def hash_obj(obj: Any) -> bytes:
        return digest(encode(obj))

    return hash_obj


# --------------------------------------------------------------------------- NONE_HASH (chain root)


def none_hash(seed: str | int, algo: str = DEFAULT_ALGO) -> bytes:
    """Chain root vLLM uses when ``PYTHONHASHSEED=seed``: ``H(seed_string)`` with the block algorithm.

    Why: this is what a reproducible deployment (fixed ``PYTHONHASHSEED``) sees, so keys computed
    offline match the engine's. vLLM hashes the environment *string* verbatim (``"0"``, even
    ``"random"``); an int ``seed`` is turned into that string (``0`` -> ``"0"``).
    """
    return _hash_fn(algo)(str(seed))


def random_none_hash() -> bytes:
    """Chain root vLLM uses when ``PYTHONHASHSEED`` is unset: 32 fresh random bytes per process.

    Why: such a deployment's keys cannot be reproduced elsewhere (nor across its own restarts);
    use this to model it, or ``none_hash`` with the deployment's seed to match it.
    """
    return os.urandom(RANDOM_ROOT_BYTES)


def none_hash_from_env(algo: str = DEFAULT_ALGO, environ: Mapping[str, str] | None = None) -> bytes:
    """Chain root a vLLM engine started with ``environ`` (default ``os.environ``) would pick."""
    seed = (os.environ if environ is None else environ).get("PYTHONHASHSEED")
    if seed is None:
        _hash_fn(algo)  # still reject unknown names
        return random_none_hash()
    return none_hash(seed, algo)


def as_event_int(key: bytes) -> int:
    """64-bit int form of a key, as vLLM emits in KV events with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES.

    Why: lets observed KV events be joined to keys computed here (low 64 bits, big-endian).
    """
    return int.from_bytes(key, "big") & 0xFFFF_FFFF_FFFF_FFFF


# --------------------------------------------------------------------------- vLLM block keys


class BlockHasher:
    """vLLM-compatible chained keys for the full blocks of a token sequence.

    ``root`` is the parent of block 0 (vLLM's ``NONE_HASH``). Give ``seed`` (the deployment's
    ``PYTHONHASHSEED``) or ``root`` (bytes) to reproduce a deployment; with neither, the root is
    chosen as vLLM would in this process (from ``PYTHONHASHSEED``, random when unset).
    """

    __slots__ = ("_hash", "algo", "block_tokens", "root")

    def __init__(
        self,
        block_tokens: int,
        algo: str = DEFAULT_ALGO,
        *,
        seed: str | int | None = None,
        root: bytes | None = None,
    ) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        if seed is not None and root is not None:
            raise ValueError("give either seed or root, not both")
        self._hash = _hash_fn(algo)
        if root is None:
            root = none_hash(seed, algo) if seed is not None else none_hash_from_env(algo)
        elif not root:
            raise ValueError("root must be non-empty bytes (vLLM replaces an empty parent by its seed)")
        self.algo = algo
        self.block_tokens = block_tokens
        self.root = bytes(root)

    def hash_block(
        self,
        parent: bytes | None,
        token_ids: Sequence[int],
        extra_keys: Sequence[Any] | None = None,
    ) -> bytes:
        """Key of one *full* block after ``parent`` (``None``/empty = first block, chained to root)."""
        if len(token_ids) != self.block_tokens:
            raise ValueError(
                f"only full blocks get keys: got {len(token_ids)} tokens, block_tokens={self.block_tokens}"
            )
        return self._hash((parent or self.root, tuple(map(int, token_ids)), _norm_extra(extra_keys)))

    def block_keys(
        self,
        token_ids: Sequence[int],
        extra_keys: Sequence[Sequence[Any] | None] | None = None,
        *,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """Keys of the full blocks of ``token_ids``, in order; a trailing partial block gets none.

        ``extra_keys[i]`` (``None``/empty for none) belongs to block ``i`` and needs at least one
        entry per full block; entries past the last full block are ignored. ``parent`` continues a
        chain whose previous block key is known (``None`` starts at the root).
        """
        bt = self.block_tokens
        tokens = list(map(int, token_ids))
        n_full = len(tokens) // bt
        if extra_keys is not None and len(extra_keys) < n_full:
            raise ValueError(f"extra_keys has {len(extra_keys)} entries for {n_full} full blocks")
        h = self._hash
        prev = parent or self.root
        keys: list[bytes] = []
        for i in range(n_full):
            extra = None if extra_keys is None else _norm_extra(extra_keys[i])
            prev = h((prev, tuple(tokens[i * bt : (i + 1) * bt]), extra))
            keys.append(prev)
        return keys


def _norm_extra(extra: Sequence[Any] | None) -> tuple[Any, ...] | None:
    """vLLM passes ``None`` when a block has no extra keys, never an empty tuple."""
    return tuple(extra) if extra else None


# --------------------------------------------------------------------------- integer chain (simulation)


def integer_chain_key(parent: int, content: Hashable) -> int:
    """One step of ``integer_chain_keys``: ``hash((parent, content))``."""
    return hash((parent, content))


def integer_chain_keys(parent: int, contents: Iterable[Hashable]) -> list[int]:
    """Cheap chained keys for simulations: ``key[k] = hash((key[k-1], contents[k]))``, ``key[-1]=parent``.

    Why: same prefix semantics as vLLM keys (block k's key depends on every earlier block) at the
    cost of one tuple hash per block, for millions of simulated blocks. Represent a block's content
    by any hashable id, e.g. ``(session, block_index)`` or a token-run id; start a fresh chain with
    ``INT_CHAIN_ROOT`` or continue one from its last key.

    CPython's hash of ints and tuples of ints is not salted, so keys are reproducible across
    processes on one 64-bit CPython version (str/bytes contents *are* salted by PYTHONHASHSEED).
    Keys are 64-bit: for n blocks the chance of any collision is about n**2 / 2**65 (~3e-6 for 10M),
    negligible for simulation; do not persist them or compare them with vLLM keys.
    """
    keys: list[int] = []
    append = keys.append
    h = parent
    for c in contents:
        h = hash((h, c))
        append(h)
    return keys
