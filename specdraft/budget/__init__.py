"""The budget: what a forward costs, what drafts achieve, and how many nodes each request gets."""

from .acceptance import AcceptanceTracker, RequestAcceptance
from .allocator import Ask, Budget, Grant
from .costs import StepCosts
from .whole_tree import WholeTreeTrial

__all__ = ["AcceptanceTracker", "Ask", "Budget", "Grant", "RequestAcceptance", "StepCosts", "WholeTreeTrial"]
