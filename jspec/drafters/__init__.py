"""Drafters behind one interface (`base.Drafter`): a draft model, Medusa heads, an EAGLE head, a DFlash block
drafter, MTP layers, n-gram and suffix lookup.
Each kind is one module here and one line in `jspec.core.registry`."""
from jspec.drafters.base import DraftContext, Drafter, DraftWeights, Features, Heads, Proposal, TreeProposal
from jspec.drafters.dflash import DFlashDrafter
from jspec.drafters.draft_model import ModelDrafter
from jspec.drafters.eagle import EagleDrafter
from jspec.drafters.medusa import MedusaDrafter
from jspec.drafters.ngram import NgramDrafter

__all__ = ["DFlashDrafter", "DraftContext", "DraftWeights", "Drafter", "EagleDrafter", "Features", "Heads",
           "MedusaDrafter", "ModelDrafter", "NgramDrafter", "Proposal", "TreeProposal"]
