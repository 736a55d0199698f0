"""The names of the shipped media criteria, read from criteria/media.yaml: what a verify over it must judge."""

from __future__ import annotations

from pathlib import Path

from kvscope.verifier.criteria import load_criteria

MEDIA = Path(__file__).resolve().parents[2] / "criteria" / "media.yaml"
MEDIA_CRITERIA = frozenset(criterion.name for criterion in load_criteria(MEDIA).criteria)
