"""The built-in drafter kinds; importing this package registers them (one module per kind)."""

from specdec.train.kind import register_kind
from specdec.train.kinds.block import DFlashKind, DSparkKind
from specdec.train.kinds.draft_model import DraftModelKind
from specdec.train.kinds.eagle import EagleKind, MtpKind

for _kind in (DraftModelKind(), EagleKind(), MtpKind(), DFlashKind(), DSparkKind()):
    register_kind(_kind)
