"""Scenarios the API tests share."""

SMALL = {
    "name": "small",
    "workload": {"kind": "multi_round", "sessions": 4, "rounds": 6, "first_prompt_tokens": 256, "output_tokens": 64},
    "kv": {"block_tokens": 16, "bytes_per_token": 1024},
    "arms": {"a": {"tiers": [{"name": "dram", "capacity": "1MiB"}]}},
}
"""Four sessions of six rounds on one 1 MiB tier: an A/B that runs in well under a second."""
