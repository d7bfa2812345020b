"""Drafters behind one interface (`base.Drafter`): a draft model, Medusa heads, an EAGLE head, n-gram lookup."""
from jspec.drafters.base import Drafter, Features, Heads, Proposal
from jspec.drafters.draft_model import ModelDrafter
from jspec.drafters.eagle import EagleDrafter
from jspec.drafters.medusa import MedusaDrafter
from jspec.drafters.ngram import NgramDrafter

__all__ = ["Drafter", "EagleDrafter", "Features", "Heads", "MedusaDrafter", "ModelDrafter", "NgramDrafter",
           "Proposal"]
