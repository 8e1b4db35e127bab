"""Drafters: the `Drafter` interface (`base`: owns draft sampling), the speculation settings
(`config`), one module or sub-package per method, and their table (`registry`)."""

from specdec.drafters.base import (
    DraftBatch,
    Drafter,
    DrafterSetup,
    Proposal,
    ProposalBuffer,
    TargetFeatures,
    draft_stream,
)
from specdec.drafters.ngram import NgramDrafter, ngram_lookup

__all__ = [
    "DraftBatch",
    "Drafter",
    "DrafterSetup",
    "NgramDrafter",
    "Proposal",
    "ProposalBuffer",
    "TargetFeatures",
    "draft_stream",
    "ngram_lookup",
]
