"""Tests for kvscope.tierstore.blockhash: vLLM-compatible chained block keys and the integer chain.

How the expected constants were computed (not by this module): a throwaway script in /tmp that
reproduces vLLM's code literally -- ``sha256``, ``sha256_cbor``, ``xxhash``, ``xxhash_cbor`` and
``get_hash_fn_by_name`` from ``vllm/utils/hashing.py``; ``init_none_hash``, ``hash_block_tokens`` and
the loop of ``get_request_block_hasher``'s ``request_block_hasher`` from
``vllm/v1/core/kv_cache_utils.py`` (vLLM main, kv_cache_utils.py at commit
001cabc1be16a59a70d720ed61a13b678c060a18; same scheme as the v0.16 docs) -- run with
``PYTHONHASHSEED=0`` on CPython 3.11.7 with cbor2 6.3.0 (cbor2 5.9.0 gave identical bytes) and
xxhash 4.1.0. Inputs: token ids ``list(range(1024)) + [7, 7, 7]`` (64 full blocks of 16 and a
3-token partial block), block_size 16, no extra keys; ``EXTRA``: tokens 0..63 with extra keys
``("my-lora", "salt-1")`` on block 0 and ``("my-lora",)`` after (vLLM's order: LoRA, mm, salt);
``MM``: tokens ``[0, 2**31, 2**40, 151643] * 8`` with ``(("mm-abc", 3),)`` on block 1 only.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from kvscope.tierstore.blockhash import (
    ALGORITHMS,
    DEFAULT_ALGO,
    INT_CHAIN_ROOT,
    BlockHasher,
    as_event_int,
    integer_chain_key,
    integer_chain_keys,
    none_hash,
    none_hash_from_env,
    random_none_hash,
)

TOKENS = [*range(1024), 7, 7, 7]
EXTRA_TOKENS = list(range(64))
EXTRA_KEYS = [("my-lora", "salt-1"), ("my-lora",), ("my-lora",), ("my-lora",)]
MM_TOKENS = [0, 2**31, 2**40, 151643] * 8
MM_KEYS = [None, (("mm-abc", 3),)]

# algo -> NONE_HASH for seed "0", for seed "42", block keys 0/1/3/63 of TOKENS, EXTRA keys, MM keys
VLLM: dict[str, dict[str, object]] = {
    "sha256": {
        "seed0": "1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c",
        "seed42": "c0bc02c9fc92a4944335649961b9e55cc41b194bece4801e8c6ef0f0f3f5884a",
        "keys": {
            0: "6358e31578a64b75ebe28cdb99d3beae65de82a2087321dc6ec84ae048faaaa6",
            1: "3c3c50f324aefbdfbb124dfdc541efac3e94e59c40f4be08afe70601eeca92c8",
            3: "71c151a876275d6b365dfa670e47acb855b683a8880eaf3e31a806c3164561b4",
            63: "d29d73b9612eadb5872788ad05fb77517637d7aa1806215a04d1773c7f3635d8",
        },
        "extra": [
            "59dc590e7d61ec59f75261d83314c0dfe2929cefdf863faa6fbe09865bc021be",
            "55a7891ba073b0540a5655e49307060f86a8510ed7e67f2500616601ae8a15a7",
            "72db3e41207e760bef13c5cc7c7c6c4ba616c6c04caffb2cb9858550b89ebf19",
            "1bca6169adacb3bd2fc13f14af462fdda9528aa0a5889d27cff824c7d21ae47c",
        ],
        "mm": [
            "62b9a9680b6338fea03d3a717375525e55cc79e9b7554f72997b7a3b9acb2b67",
            "3307b8a810334f25ab7773c1aaeaf240796cfb85a66d34637d77d0b40ff6790f",
        ],
    },
    "sha256_cbor": {
        "seed0": "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e",
        "seed42": "9fa6eb003f14425eb9c8e6baacfbcaab26257357b829c7bfa74ffcc4f31c1780",
        "keys": {
            0: "d830de3d42c00f25a2949b5d12d98642664a44872c1614c5b0147556276afc9c",
            1: "fedd9e4abebebbe6f6cf96b682f08d316063fe2f22a5c552192dd62904fcccac",
            3: "b1f3544e8610283e85cddbae23bfcad68fa546e89c0fd85aed820e94dca2d75f",
            63: "c8f0558ed10a0916153d8b56860294b2a44fce5df607fb92358de88a793a1da9",
        },
        "extra": [
            "4a9d555aa527228a76346076d9f5df3f630608ea7a980696074ddf5635c87a75",
            "c4310d7e2941ba6e595091ed213918b64adcc8c94074d381dcb80d597a24491c",
            "1b295d8086e5d1f1ba70f45cbf8e4b88d4a3b504f860ece68cdf7c388d41e440",
            "49cc88c6e22ef1d7f41234cd3622b262066cf48698f87e5f4410371b5205d8bd",
        ],
        "mm": [
            "359863405dd67926aff24bca45bd9ec14cf2cdd9dc71aa13d8088cde4f0bb931",
            "370ae3a5f4acc35fc6e074eda93c0ce59a42c1c2ea7020aa6c7fd2e46f389d9f",
        ],
    },
    "xxhash": {
        "seed0": "6fb31cc38bba6066183f7f2104b9c051",
        "seed42": "b6cdd80ea04b31ad0b9fc22fff500882",
        "keys": {
            0: "8ef953407c0da43eacbb3639ed2bff4d",
            1: "5a51cc5ac3a4b1f7d5efd012fb00201a",
            3: "4c6d0809eadbf723e6a711473eaabfc7",
            63: "cabc25e49e4d4a57a52acea4941b0a49",
        },
        "extra": [
            "b8f07eb26492eb7d0f1f32954bf39746",
            "1d3d16770ce3f7e7308db16c624262a7",
            "2c719643fb58b6cba0d78b977c117e62",
            "e4a6cd489b8f8eae0b00da75f52059b8",
        ],
        "mm": ["b9224bd5ccd3b30a4766116a620bf1e6", "e70f443c86541465f4dc32e652313c19"],
    },
    "xxhash_cbor": {
        "seed0": "1ebe36576dcb573f26b99533a20aaeca",
        "seed42": "a9d2e63407fce1a26c9dc9d7fa2d7caf",
        "keys": {
            0: "209f5d549fc07c8e39d823615ede61ce",
            1: "03888914ee75b87e89df867a21beb72b",
            3: "dded063a77619320b35ddd29befbf9f1",
            63: "c8f41d00a040b3afa8e671c2bc3967fa",
        },
        "extra": [
            "24b3cc87ba6ef837cb8e5d78cea8a6d6",
            "3e891eebc7eac6e36a848a65f29666d1",
            "efdf1553af0e7fa807bb00631d2f0d8c",
            "85c93dfdc7311e7e4ff4066519b3d2d5",
        ],
        "mm": ["6147b475e299b4da7b9f29b268ab1ae9", "b6e3ba03bad30d4ad226c4f059c0253f"],
    },
}

_HAS_XXHASH = importlib.util.find_spec("xxhash") is not None
ALGO_PARAMS = [
    pytest.param(
        a,
        marks=pytest.mark.skipif(a.startswith("xxhash") and not _HAS_XXHASH, reason="xxhash not installed"),
    )
    for a in ALGORITHMS
]


def test_default_is_vllm_default() -> None:
    assert DEFAULT_ALGO == "sha256"
    assert BlockHasher(16, seed="0").algo == "sha256"


@pytest.mark.parametrize("algo", ALGO_PARAMS)
def test_none_hash_matches_vllm(algo: str) -> None:
    assert none_hash("0", algo).hex() == VLLM[algo]["seed0"]
    assert none_hash("42", algo).hex() == VLLM[algo]["seed42"]
    assert none_hash(42, algo) == none_hash("42", algo)  # PYTHONHASHSEED is a string in vLLM
    assert none_hash_from_env(algo, {"PYTHONHASHSEED": "0"}).hex() == VLLM[algo]["seed0"]


@pytest.mark.parametrize("algo", ALGO_PARAMS)
def test_block_keys_match_vllm(algo: str) -> None:
    keys = BlockHasher(16, algo, seed="0").block_keys(TOKENS)
    assert len(keys) == 64  # the 3-token tail is not hashed
    assert {i: keys[i].hex() for i in VLLM[algo]["keys"]} == VLLM[algo]["keys"]
    # Same chain when the root is given as bytes (e.g. NONE_HASH of a deployment).
    assert BlockHasher(16, algo, root=bytes.fromhex(VLLM[algo]["seed0"])).block_keys(TOKENS) == keys


@pytest.mark.parametrize("algo", ALGO_PARAMS)
def test_extra_keys_match_vllm(algo: str) -> None:
    hasher = BlockHasher(16, algo, seed="0")
    assert [k.hex() for k in hasher.block_keys(EXTRA_TOKENS, EXTRA_KEYS)] == VLLM[algo]["extra"]
    assert [k.hex() for k in hasher.block_keys(MM_TOKENS, MM_KEYS)] == VLLM[algo]["mm"]


def test_hash_block_is_one_step_of_the_chain() -> None:
    hasher = BlockHasher(16, seed="0")
    keys = hasher.block_keys(TOKENS)
    assert hasher.hash_block(None, TOKENS[:16]) == keys[0]
    assert hasher.hash_block(b"", TOKENS[:16]) == keys[0]  # vLLM: falsy parent -> NONE_HASH
    assert hasher.hash_block(keys[0], TOKENS[16:32]) == keys[1]
    # Continuing from a known parent gives the tail of the same chain.
    assert hasher.block_keys(TOKENS[32:], parent=keys[1]) == keys[2:]


def test_tokens_are_normalised_to_int() -> None:
    hasher = BlockHasher(4, seed="0")
    assert hasher.block_keys([True, 2, 3, 4]) == hasher.block_keys([1, 2, 3, 4])
    assert hasher.block_keys(range(8)) == hasher.block_keys(list(range(8)))


def test_changing_block_0_changes_every_key() -> None:
    hasher = BlockHasher(16, seed="0")
    base = hasher.block_keys(TOKENS)
    changed = list(TOKENS)
    changed[5] += 1
    other = hasher.block_keys(changed)
    assert all(a != b for a, b in zip(base, other, strict=True))


def test_changing_block_3_changes_keys_3_onward_only() -> None:
    hasher = BlockHasher(16, "sha256_cbor", seed="0")
    base = hasher.block_keys(TOKENS)
    changed = list(TOKENS)
    changed[3 * 16 + 15] = 999_999
    other = hasher.block_keys(changed)
    assert other[:3] == base[:3]
    assert all(a != b for a, b in zip(base[3:], other[3:], strict=True))


def test_partial_block_is_not_hashed() -> None:
    hasher = BlockHasher(16, seed="0")
    assert hasher.block_keys(TOKENS[:15]) == []
    assert len(hasher.block_keys(TOKENS[:1023])) == 63
    assert hasher.block_keys(TOKENS[:1024]) == hasher.block_keys(TOKENS)  # tail of 3 adds nothing
    with pytest.raises(ValueError, match="only full blocks"):
        hasher.hash_block(None, TOKENS[:15])


def test_extra_keys_change_the_key_and_the_rest_of_the_chain() -> None:
    hasher = BlockHasher(16, seed="0")
    base = hasher.block_keys(EXTRA_TOKENS)
    assert hasher.block_keys(EXTRA_TOKENS, [None] * 4) == base
    assert hasher.block_keys(EXTRA_TOKENS, [(), [], None, ()]) == base  # empty == none, as in vLLM
    salted = hasher.block_keys(EXTRA_TOKENS, [None, None, ("tenant-a",), None])
    assert salted[:2] == base[:2]
    assert all(a != b for a, b in zip(base[2:], salted[2:], strict=True))
    tenant_b = hasher.block_keys(EXTRA_TOKENS, [None, None, ("tenant-b",), None])
    assert tenant_b[2] != salted[2]
    # One entry per full block is required; entries for the partial tail are ignored.
    assert hasher.block_keys([*EXTRA_TOKENS, 1], [None] * 5) == base
    with pytest.raises(ValueError, match="extra_keys"):
        hasher.block_keys(EXTRA_TOKENS, [None] * 3)


def test_seed_and_algorithm_change_the_root() -> None:
    roots = {none_hash(s, a) for s in ("0", "1") for a in ("sha256", "sha256_cbor")}
    assert len(roots) == 4
    assert BlockHasher(16, seed="0").block_keys(TOKENS)[0] != BlockHasher(16, seed="1").block_keys(TOKENS)[0]


def test_unset_seed_is_random_per_process_like_vllm() -> None:
    a, b = none_hash_from_env("sha256", {}), none_hash_from_env("sha256", {})
    assert len(a) == len(b) == 32 and a != b
    assert len(random_none_hash()) == 32
    # No seed/root: the root vLLM would pick in this process (PYTHONHASHSEED, random when unset).
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        assert BlockHasher(16).root != BlockHasher(16).root
    else:
        assert BlockHasher(16).root == none_hash(seed)


@pytest.mark.parametrize("bad", ["sha1", "SHA256", "", "xxh3"])
def test_unknown_algorithm_is_named(bad: str) -> None:
    with pytest.raises(ValueError, match=f"unknown prefix-caching hash algorithm '{bad}'"):
        BlockHasher(16, bad, seed="0")
    with pytest.raises(ValueError, match=repr(bad)):
        none_hash("0", bad)
    with pytest.raises(ValueError, match=repr(bad)):
        none_hash_from_env(bad, {})


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="block_tokens"):
        BlockHasher(0, seed="0")
    with pytest.raises(ValueError, match="either seed or root"):
        BlockHasher(16, seed="0", root=b"\x01" * 32)
    with pytest.raises(ValueError, match="non-empty"):
        BlockHasher(16, root=b"")


def test_as_event_int_is_low_64_bits_big_endian() -> None:
    key = bytes.fromhex(VLLM["sha256"]["keys"][0])
    assert as_event_int(key) == int.from_bytes(key[-8:], "big") == 0x6EC84AE048FAAAA6


def test_integer_chain_semantics() -> None:
    contents = [(7, i) for i in range(10)]
    keys = integer_chain_keys(INT_CHAIN_ROOT, contents)
    assert len(keys) == 10
    assert keys[0] == integer_chain_key(INT_CHAIN_ROOT, contents[0])
    assert all(keys[k] == integer_chain_key(keys[k - 1], contents[k]) for k in range(1, 10))
    # Same prefix -> same keys; block 3 differs -> keys 3+ differ, 0..2 equal.
    changed = integer_chain_keys(INT_CHAIN_ROOT, [*contents[:3], (8, 3), *contents[4:]])
    assert changed[:3] == keys[:3]
    assert all(a != b for a, b in zip(keys[3:], changed[3:], strict=True))
    # Block 0 differs -> every key differs, even where the contents coincide.
    shifted = integer_chain_keys(INT_CHAIN_ROOT, [(9, 0), *contents[1:]])
    assert all(a != b for a, b in zip(keys, shifted, strict=True))
    # Continuing from a parent equals the tail of the whole chain; another root gives another chain.
    assert integer_chain_keys(keys[4], contents[5:]) == keys[5:]
    assert integer_chain_keys(12345, contents)[0] != keys[0]
    assert integer_chain_keys(INT_CHAIN_ROOT, []) == []
    assert integer_chain_keys(INT_CHAIN_ROOT, iter(contents)) == keys


def test_integer_chain_is_not_salted_for_int_contents() -> None:
    code = (
        "from kvscope.tierstore.blockhash import integer_chain_keys as f;"
        "print(f(0, [(3, i) for i in range(5)] + list(range(5))))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1
    assert outs == {f"{integer_chain_keys(0, [(3, i) for i in range(5)] + list(range(5)))}\n"}


def test_integer_chain_million_blocks_no_collisions() -> None:
    keys = integer_chain_keys(INT_CHAIN_ROOT, ((s, b) for s in range(1000) for b in range(1000)))
    assert len(keys) == 1_000_000
    assert len(set(keys)) == 1_000_000
