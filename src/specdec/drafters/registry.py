"""The table of drafters: `speculative_config.method` -> `Drafter` class, written out once (its
keys are `SPECULATIVE_METHODS`, which a test checks), and `build_drafter`, the one way the engine
makes a drafter."""

from __future__ import annotations

from specdec.drafters.base import Drafter, DrafterSetup
from specdec.drafters.block.dflash import DFlashDrafter
from specdec.drafters.block.dspark import DSparkDrafter
from specdec.drafters.config import SpeculativeConfig
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.eagle.drafter import EagleDrafter
from specdec.drafters.medusa import MedusaDrafter
from specdec.drafters.mtp_chain import MtpDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.models import LlamaForCausalLM

DRAFTERS: dict[str, type[Drafter]] = {
    "ngram": NgramDrafter,
    "draft_model": DraftModelDrafter,
    "eagle": EagleDrafter,
    "eagle3": EagleDrafter,  # vLLM's name for EAGLE-3 heads (which "eagle" loads too)
    "mtp": MtpDrafter,  # the target's own MTP layers (`drafters.mtp`), or any "eagle" head
    "dflash": DFlashDrafter,
    "dspark": DSparkDrafter,
    "medusa": MedusaDrafter,
}


def build_drafter(
    spec: SpeculativeConfig, target: LlamaForCausalLM, setup: DrafterSetup
) -> Drafter:
    """The drafter of `spec`, drafting for `target` with the engine's `setup`."""
    return DRAFTERS[spec.method].from_config(spec, target, setup)
