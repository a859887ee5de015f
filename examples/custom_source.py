"""A new draft source in one class, checked against ``model.generate`` on a tiny random model.

This is the worked example of docs/tutorials/write-a-source.md as a script. It needs no download
and runs in a few seconds on a CPU:

    python examples/custom_source.py

It defines two sources:

* ``BigramTable``: per request, counts which token followed which (prompt and output) and
  proposes chains of the most frequent successors, best first.
* ``ProbingBigrams``: the same, plus a *side block* that asks the model, in the same forward
  pass, what it would write after a few recent tokens, and learns from the answers. It shows the
  side-block mechanics that Jacobi lookahead decoding builds on.

Then it decodes with them on a float64 random Llama and asserts that the output is token for
token the output of ``model.generate`` (greedy, with and without a repetition penalty).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdraft import Context, Decoder, Draft, DraftSource, Feedback, PromptLookup, SideBlock

# (The "--8<--" comments mark the parts the documentation includes; they do nothing here.)


# --8<-- [start:bigram]
class BigramTable:
    """Draft source: chains of the most frequent successor, learned per request.

    State is a bigram table per ``request_id``: ``table[a][b]`` counts how often ``b`` followed
    ``a`` in the prompt and the committed output. ``propose`` starts one branch with each of the
    root's ``max_branches`` most frequent successors (best first) and extends each branch by
    following the most frequent successor of its last token.
    """

    def __init__(self, num_tokens: int = 8, max_branches: int = 3, name: str = "bigram") -> None:
        if num_tokens < 1 or max_branches < 1:
            raise ValueError("num_tokens and max_branches must be >= 1")
        self.num_tokens = num_tokens
        self.max_branches = max_branches
        self.name = name
        # request_id -> (bigram table, number of context tokens already counted)
        self._state: dict[int, tuple[defaultdict[int, Counter], int]] = {}

    # -- the protocol ------------------------------------------------------------------------

    def begin(self, context: Context) -> None:
        self._state[context.request_id] = (defaultdict(Counter), 0)
        self._count(context)

    def propose(self, context: Context, budget: int) -> Draft:
        state = self._state.get(context.request_id)
        if state is None or budget <= 0:
            return Draft()
        table, _ = state
        branches: list[list[int]] = []
        for first, _count in table[context.root].most_common(self.max_branches):
            length = min(self.num_tokens, budget)
            if length <= 0:
                break
            branch = [first]
            while len(branch) < length and table[branch[-1]]:
                branch.append(table[branch[-1]].most_common(1)[0][0])
            branches.append(branch)
            budget -= len(branch)
        return Draft(branches=branches)

    def observe(self, feedback: Feedback) -> None:
        if feedback.context.request_id in self._state:
            self._count(feedback.context)

    def end(self, context: Context) -> None:
        self._state.pop(context.request_id, None)

    # -- helpers -------------------------------------------------------------------------------

    def _count(self, context: Context) -> None:
        """Add the bigrams of the context tokens not counted yet."""
        table, counted = self._state[context.request_id]
        tokens = context.tokens
        for i in range(max(counted, 1), len(tokens)):
            table[tokens[i - 1]][tokens[i]] += 1
        self._state[context.request_id] = (table, len(tokens))
# --8<-- [end:bigram]


# --8<-- [start:probing]
class ProbingBigrams(BigramTable):
    """``BigramTable`` plus a side block: "what would you write after token x, right now?"

    Each step it places up to ``probes`` recent tokens in a side block, each at offset 1 (as if it
    came right after the root), seeing the cache and the root but not each other (a diagonal
    mask). The model's argmax for each probe comes back in ``Feedback.side_logits`` and is
    recorded as a successor of that token. The probes cost forward width, not correctness: side
    tokens are never verified, never committed and never kept in the cache.
    """

    def __init__(self, probes: int = 4, **kwargs) -> None:
        kwargs.setdefault("name", "probing-bigram")
        super().__init__(**kwargs)
        self.probes = probes
        self._asked: dict[int, list[int]] = {}  # request_id -> the tokens probed this step

    def propose(self, context: Context, budget: int) -> Draft:
        draft = super().propose(context, budget)
        recent = list(dict.fromkeys(reversed(context.tokens[-16:-1])))[: self.probes]
        self._asked[context.request_id] = recent
        if recent:
            draft.side_block = SideBlock(tokens=recent, positions=[1] * len(recent),
                                         mask=np.eye(len(recent), dtype=bool), sees_root=True)
        return draft

    def observe(self, feedback: Feedback) -> None:
        super().observe(feedback)
        asked = self._asked.pop(feedback.context.request_id, [])
        state = self._state.get(feedback.context.request_id)
        if feedback.side_logits is None or state is None:
            return
        table, _ = state
        for token, row in zip(asked, feedback.side_logits):
            table[token][int(row.argmax())] += 1

    def end(self, context: Context) -> None:
        super().end(context)
        self._asked.pop(context.request_id, None)
# --8<-- [end:probing]


# --8<-- [start:check]
def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer random Llama in float64 (no download, exact arithmetic for the comparison)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa")
    return LlamaForCausalLM(config).to(torch.float64).eval()


def plain_generate(model, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


def main() -> None:
    torch.set_num_threads(1)  # a model this small is fastest on one thread (no thread-pool overhead)
    assert isinstance(BigramTable(), DraftSource) and isinstance(ProbingBigrams(), DraftSource)
    model = tiny_model()
    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(3, 96, size=n).tolist() for n in (5, 20, 40)]
    prompts.append([1] + [10, 11, 12, 13, 14, 15] * 5)  # a repetitive prompt
    setups = {
        "bigram": [BigramTable()],
        "probing-bigram": [ProbingBigrams()],
        "prompt + bigram": [PromptLookup(), BigramTable()],
    }
    max_new = 64
    for label, sources in setups.items():
        for budget in (4, 32):
            dec = Decoder(model, sources=sources, max_tree_nodes=budget)
            for prompt in prompts:
                for extra in ({}, {"repetition_penalty": 1.3}):
                    expected = plain_generate(model, prompt, max_new, **extra)
                    out = dec.generate(prompt, max_new_tokens=max_new, **extra)
                    assert out.token_ids == expected, (label, budget, prompt, extra)
        # the sources must have dropped every request's state
        assert all(not s._state for s in sources if isinstance(s, BigramTable))
    # --8<-- [end:check]

    # One generation in detail.
    prompt = prompts[-1]
    dec = Decoder(model, sources=[ProbingBigrams(), BigramTable()], max_tree_nodes=16)
    t0 = time.perf_counter()
    out = dec.generate(prompt, max_new_tokens=200)
    t1 = time.perf_counter()
    expected = plain_generate(model, prompt, 200)
    t2 = time.perf_counter()
    assert out.token_ids == expected
    s = out.stats
    print(f"identical to model.generate: yes ({len(prompts)} prompts x {len(setups)} source mixes\n"
          "  x 2 budgets x with/without repetition penalty, plus this run)")
    print(s.summary())
    for name, per in s.per_source.items():
        print(f"  {name:15s} proposed {per.proposed:5d}  accepted {per.accepted:4d}")
    print(f"  accept lengths (first 16 steps): {s.accept_lengths[:16]}")
    print(f"  time: specdraft {t1 - t0:.2f} s, model.generate {t2 - t1:.2f} s")


if __name__ == "__main__":
    main()
