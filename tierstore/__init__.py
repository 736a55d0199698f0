"""Embedded tiered KV block store: chained keys, tiers, eviction policies, workloads, planner, A/B runner."""
