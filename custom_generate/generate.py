"""specdraft's exact speculative decoding behind ``model.generate``, loadable by transformers.

    model.generate(**inputs, custom_generate="path/to/this/folder", trust_remote_code=True)

transformers loads this file (from a local folder or a Hub repository with this layout) and calls
its ``generate(model, **arguments_of_generate)`` instead of its own. It runs transformers'
``generate`` with specdraft's decoding loop: same inputs, same outputs, greedy output token for
token, sampling with the same law, several prompts decoded together. An extra keyword,
``specdraft_loop=specdraft.hf.loop(...)``, chooses the draft sources and the tree budget; without
it a loop with the default sources is made once and reused. What is supported and what is refused
(with an error naming it) is listed in specdraft's documentation, page "Make your existing
generate call faster".
"""

from specdraft.hf import generate

__all__ = ["generate"]
