"""specdraft: make any Hugging Face causal LM generate the same text faster, with no draft model.

Draft sources guess the next tokens, their guesses merge into one token tree, the model checks the
tree in one forward pass and an exact verifier keeps the longest path the model agrees with.
"""

from .batching import BatchRequest
from .decoder import Decoder, GenerationOutput
from .engine import BatchOutput, BatchResult
from .model.runner import UnsupportedModelError
from .sampling import SamplingSettings, UnsupportedOptionError
from .sources import Context, Draft, DraftSource, Feedback, PromptLookup, SideBlock
from .sources import MultiLevelNGram
from .sources import FrequencyTrie
from .sources import JacobiLookahead
from .sources import TokenRecycling
from .sources import SuffixTree
from .sources.bulk import settle_long_lived
from .stats import GenerationStats, SourceStats
from .tree import TokenTree

__all__ = [
    "Decoder", "GenerationOutput", "BatchRequest", "BatchOutput", "BatchResult", "GenerationStats", "SourceStats", "SamplingSettings", "UnsupportedOptionError",
    "UnsupportedModelError",
    "Context", "Draft", "DraftSource", "Feedback", "PromptLookup", "SideBlock", "TokenTree",
    "MultiLevelNGram",
    "FrequencyTrie",
    "JacobiLookahead",
    "TokenRecycling",
    "SuffixTree",
    "settle_long_lived",
]
__version__ = "0.1.0"
