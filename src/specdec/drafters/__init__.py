"""Drafters: the `Drafter` base (owns draft sampling) and its implementations."""

from specdec.drafters.base import DraftBatch, Drafter, Proposal, TargetFeatures, draft_stream
from specdec.drafters.ngram import NgramDrafter, ngram_lookup

__all__ = [
    "DraftBatch",
    "Drafter",
    "NgramDrafter",
    "Proposal",
    "TargetFeatures",
    "draft_stream",
    "ngram_lookup",
]
