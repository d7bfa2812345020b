"""Drafters behind one interface (`base.Drafter`): a draft model, Medusa heads, an EAGLE head, n-gram lookup.
Each kind is one module here and one line in `jspec.core.registry`."""
from jspec.drafters.base import DraftContext, Drafter, DraftWeights, Features, Heads, Proposal, TreeProposal
from jspec.drafters.draft_model import ModelDrafter
from jspec.drafters.eagle import EagleDrafter
from jspec.drafters.medusa import MedusaDrafter
from jspec.drafters.ngram import NgramDrafter

__all__ = ["DraftContext", "DraftWeights", "Drafter", "EagleDrafter", "Features", "Heads", "MedusaDrafter",
           "ModelDrafter", "NgramDrafter", "Proposal", "TreeProposal"]
