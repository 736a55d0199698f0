"""Miss causes held between a real arm and its mirror (the embedded store's model of it, on the same requests)."""

from __future__ import annotations

from kvscope.tierstore.misses import CAUSES


def assert_causes_follow(real: list[dict], mirror: list[dict], tolerance: float) -> None:
    """Every round of the real arm: its causes add up to its misses, and each is within `tolerance` of the round's
    prompt tokens of the mirror's."""
    for row, modelled in zip(real, mirror, strict=True):
        causes = row["miss_causes"]
        assert sum(causes[cause] for cause in CAUSES) == row["query_tokens"] - row["hit_tokens"], row
        assert causes["evicted"] == sum(causes["evicted_by_tier"].values()), row
        for cause in CAUSES:
            gap = abs(causes[cause] - modelled["miss_causes"][cause]) / row["query_tokens"]
            assert gap <= tolerance, (row["round"], cause, causes, modelled["miss_causes"])
