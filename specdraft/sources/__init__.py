"""Draft sources: each guesses continuations; the decoder merges their guesses into one tree."""

from .base import Context, Draft, DraftSource, Feedback, SideBlock, SourceBase
from .jacobi import JacobiLookahead
from .ngram import MultiLevelNGram
from .prompt_lookup import PromptLookup
from .trie import FrequencyTrie
from .token_recycling import TokenRecycling
from .suffix_tree import SuffixTree

__all__ = ["Context", "Draft", "DraftSource", "Feedback", "SideBlock", "SourceBase", "PromptLookup", "MultiLevelNGram",
           "FrequencyTrie", "JacobiLookahead", "TokenRecycling", "SuffixTree"]
