"""The table of drafter kinds `train-drafter --kind` accepts: name -> `DrafterKind`, written out
here once (no self-registration, so the kinds never import this module back)."""

from __future__ import annotations

from specdec.train.kind import DrafterKind
from specdec.train.kinds.block import DFlashKind, DSparkKind
from specdec.train.kinds.draft_model import DraftModelKind
from specdec.train.kinds.eagle import EagleKind, MtpKind

DRAFTER_KINDS: dict[str, DrafterKind] = {
    kind.name: kind
    for kind in (DraftModelKind(), EagleKind(), MtpKind(), DFlashKind(), DSparkKind())
}


def get_kind(name: str) -> DrafterKind:
    """The drafter kind called `name`."""
    if name not in DRAFTER_KINDS:
        raise ValueError(f"unknown drafter kind {name!r}; known: {sorted(DRAFTER_KINDS)}")
    return DRAFTER_KINDS[name]


def kind_names() -> list[str]:
    return sorted(DRAFTER_KINDS)
