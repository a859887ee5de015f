"""Per-step cost of the frequency trie (retrieval + insertion) next to a model forward.

The trie works on the hot path: every decoding step calls ``propose`` (retrieval) and ``observe``
(insertion of the windows the step completed); ``begin`` / ``end`` run once per request (prompt
insertion, elimination). This script replays realistic token streams through a warmed trie with no
model at all and reports the cost per step as a fraction of a Qwen2.5-0.5B fp32 CPU step (~145 ms
for one token, ~390 ms for a 16-token tree, 1 thread, measured on this machine).

Streams: Python source files of the installed ``transformers`` package (its ``modeling_*.py``,
much copied code, like the repeated structure a serving trie sees), tokenized with the
Qwen2.5-Coder tokenizer. Each simulated request takes ``--prompt-tokens`` of a file as the prompt
and its next ``--output-tokens`` as the "model's" answer. A step proposes with the decoder's
default budget, merges the branches into a :class:`~specdraft.tree.TokenTree` exactly as the
decoder does, accepts the longest tree path that agrees with the true continuation plus one bonus
token, and calls ``observe``: the same calls, in the same order, as ``Decoder`` makes. The first
``--warm`` requests warm the trie (as the paper warms it with its dev set, Sec. 5.1) and are not
timed. Besides time, the run reports the simulated mean accepted tokens per step, which shows
what a configuration buys.

It also times the selection step through pygtrie's public API (``Trie.traverse`` with lazy
children) against the child index ``FrequencyTrie`` keeps next to the pygtrie, one prune of each
kind on every warmed trie (its largest first-token tree down to ``prune_to`` of its size, and the
whole trie down to ``prune_to`` of its size), and the memory a node takes (``tracemalloc``).

``capacity`` is per first-token tree (the paper's 16 x decoding length, read as in the authors'
implementation) and ``max_nodes`` bounds the whole trie; the "global cap 1024" row is the earlier
reading, one 16 x decoding-length capacity for the whole trie, for comparison.

    python benchmarks/trie_overhead.py            # full run (~1-2 minutes)
    python benchmarks/trie_overhead.py --quick    # fewer requests
"""

from __future__ import annotations

import argparse
import gc
import glob
import heapq
import itertools
import json
import os
import statistics
import sys
import time

from specdraft.sources.base import Context, Feedback
from specdraft.sources.trie import FrequencyTrie
from specdraft.tree import TokenTree

ONE_TOKEN_STEP_MS = 145.0  # Qwen2.5-0.5B fp32, 1 thread, one-token step (this machine)
TREE_STEP_MS = 390.0  # same, 16-token tree step
TOKENIZER = "qwen2.5-coder-0.5b"  # a specdraft.models alias: found in the cache or fetched once
SELECTION_ON = "max_nodes 262144"  # the configuration whose warmed trie the two selection methods are compared on
CLOCK = time.perf_counter_ns  # --clock cpu: time.thread_time_ns (CPU time, immune to a busy machine)


def load_tokenizer(name: str):
    """The tokenizer of a model named as ``specdraft.models.load_model`` takes it (a checkpoint
    directory, a ``.gguf`` file, a hub id or a mirrored alias such as ``qwen2.5-coder-0.5b``)."""
    from specdraft.models import load_tokenizer as load

    return load(name)


def load_streams(n_files: int, model: str) -> list[list[int]]:
    import transformers

    tok = load_tokenizer(model)
    root = os.path.dirname(transformers.__file__)
    files = sorted(glob.glob(os.path.join(root, "models", "*", "modeling_*.py")))
    files = [f for f in files if os.path.getsize(f) > 20_000]
    step = max(1, len(files) // n_files)
    streams = []
    for path in files[::step][:n_files]:
        with open(path, encoding="utf-8") as fh:
            streams.append(tok(fh.read(), add_special_tokens=False)["input_ids"])
    return streams


def accepted_length(tree: TokenTree, truth: list[int]) -> int:
    """Greedy verification against a known continuation: the longest tree path equal to it."""
    node, n = 0, 0
    for token in truth:
        nxt = tree.child(node, token)
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n


class GCClock:
    """Time spent in Python's cyclic garbage collector (part of every figure above; shown apart)."""

    def __init__(self) -> None:
        self.ns = 0
        self.collections = [0, 0, 0]
        self._t = 0

    def __call__(self, phase, info) -> None:
        if phase == "start":
            self._t = CLOCK()
        else:
            self.ns += CLOCK() - self._t
            self.collections[info["generation"]] += 1

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def run_requests(trie: FrequencyTrie, requests, budget: int, timed: bool, rid0: int):
    """Replay requests like Decoder does; return per-step timings (ns) and totals."""
    propose_ns, observe_ns, accepts = [], [], []
    begin_ns = end_ns = 0
    rid = rid0
    for prompt, answer in requests:
        rid += 1
        tokens = list(prompt)
        t0 = CLOCK()
        trie.begin(Context(tuple(tokens), len(prompt), rid))
        begin_ns += CLOCK() - t0
        at = 0
        while at < len(answer):
            context = Context(tuple(tokens), len(prompt), rid)
            t0 = CLOCK()
            draft = trie.propose(context, budget)
            t1 = CLOCK()
            tree = TokenTree.from_drafts(context.root, [draft.branches], budget)
            truth = answer[at:]
            n = min(accepted_length(tree, truth) + 1, len(truth))
            step = truth[:n]
            tokens.extend(step)
            at += n
            t2 = CLOCK()
            trie.observe(Feedback(committed=step, context=Context(tuple(tokens), len(prompt), rid)))
            t3 = CLOCK()
            propose_ns.append(t1 - t0)
            observe_ns.append(t3 - t2)
            accepts.append(n)
        t0 = CLOCK()
        trie.end(Context(tuple(tokens), len(prompt), rid))
        end_ns += CLOCK() - t0
    return dict(propose_ns=propose_ns, observe_ns=observe_ns, accepts=accepts, begin_ns=begin_ns, end_ns=end_ns,
                requests=len(requests), rid=rid)


def make_requests(streams, prompt_tokens: int, output_tokens: int, per_file: int):
    out = []
    for s in streams:
        span = prompt_tokens + output_tokens
        for j in range(per_file):
            a = (len(s) - span) * (j + 1) // (per_file + 1)
            if a < 0:
                continue
            out.append((s[a : a + prompt_tokens], s[a + prompt_tokens : a + span]))
    return out


def bytes_per_node(streams, tokens: int = 20_000) -> tuple[int, float]:
    """Memory per node of a trie built from ``tokens`` stream tokens (output windows), by tracemalloc:
    everything allocated and still alive (nodes, child dicts, pygtrie nodes, keys), over the node count."""
    import tracemalloc

    toks = [t for s in streams for t in s][:tokens]
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        trie = FrequencyTrie(capacity=10**9, max_nodes=10**9)
        trie.insert(toks)
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    return len(trie), used / len(trie)


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# -- the selection step through pygtrie's public API, for comparison ------------------------------------


def _factory(key_from_path, path, children, value=None):
    return value, children


def retrieve_traverse(ft: FrequencyTrie, tokens, k: int) -> int:
    """FrequencyTrie's multi-stage retrieval with the selection done by ``pygtrie.Trie.traverse``
    (lazy children) instead of the child index; returns the number of nodes selected."""
    pt, w = ft.trie, ft.prompt_weight
    need = min(ft.min_nodes, k)
    best = 0
    n = len(tokens)
    for m in range(min(ft.branch_length, n), 0, -1):
        key = tuple(tokens[n - m :])
        if not pt.has_subtrie(key):
            continue
        _, children = pt.traverse(_factory, prefix=key)
        tie = itertools.count()
        heap = [(-(v.out + w * v.prompt), -v.stamp, next(tie), ch) for v, ch in children]
        heapq.heapify(heap)
        count = 0
        while heap and count < k:
            _, _, _, ch = heapq.heappop(heap)
            count += 1
            for v, grand in ch:
                heapq.heappush(heap, (-(v.out + w * v.prompt), -v.stamp, next(tie), grand))
        if count >= need:
            return count
        best = max(best, count)
    return best


def compare_selection(ft: FrequencyTrie, contexts, k: int) -> dict:
    index_ns, traverse_ns = [], []
    for tokens in contexts:
        t0 = CLOCK()
        branches = ft.retrieve(tokens, k)
        t1 = CLOCK()
        count = retrieve_traverse(ft, tokens, k)
        t2 = CLOCK()
        nodes = len({tuple(b[:i]) for b in branches for i in range(1, len(b) + 1)})
        assert nodes == count, (nodes, count)
        index_ns.append(t1 - t0)
        traverse_ns.append(t2 - t1)
    return dict(child_index_us=statistics.mean(index_ns) / 1e3, pygtrie_traverse_us=statistics.mean(traverse_ns) / 1e3,
                child_index_p99_us=pct(index_ns, 0.99) / 1e3, pygtrie_traverse_p99_us=pct(traverse_ns, 0.99) / 1e3)


# -- main ---------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=TOKENIZER,
                    help="model whose tokenizer encodes the text: checkpoint dir, .gguf, hub id or mirrored alias "
                         "(default: %(default)s)")
    ap.add_argument("--files", type=int, default=24, help="source files to draw requests from")
    ap.add_argument("--per-file", type=int, default=2, help="requests per file")
    ap.add_argument("--warm", type=int, default=24, help="requests that warm the trie (not timed)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--budget", type=int, default=32, help="node budget per step (Decoder's max_tree_nodes)")
    ap.add_argument("--quick", action="store_true", help="8 files, 8 warm-up requests")
    ap.add_argument("--json", action="store_true", help="also print one JSON line per configuration")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall time (default) or this thread's CPU time (steadier when other jobs share the CPUs)")
    args = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.perf_counter_ns if args.clock == "wall" else time.thread_time_ns
    if args.quick:
        args.files, args.warm = 8, 8

    t0 = time.perf_counter()
    streams = load_streams(args.files, args.tokenizer)
    requests = make_requests(streams, args.prompt_tokens, args.output_tokens, args.per_file)
    # interleave files so warm-up and measured requests come from all of them
    requests = requests[0::2] + requests[1::2]
    warm, measured = requests[: args.warm], requests[args.warm :]
    print(f"{len(streams)} files, {sum(map(len, streams))} tokens (loaded in {time.perf_counter() - t0:.1f} s); "
          f"{len(warm)} warm-up + {len(measured)} measured requests of {args.prompt_tokens} prompt + "
          f"{args.output_tokens} output tokens; budget {args.budget}; {args.clock} clock; python {sys.version.split()[0]}")

    configs = [
        ("default (1024/tree, max_nodes 131072)", dict()),
        ("L_d=32 (512/tree)", dict(decoding_length=32)),
        ("4096/tree", dict(capacity=4096)),
        ("max_nodes 16384", dict(max_nodes=16384)),
        ("max_nodes 262144", dict(max_nodes=262144)),
        ("default, parallel", dict(mode="parallel")),
        ("default, no prompt", dict(insert_prompt=False)),
        ("global cap 1024 (earlier reading)", dict(capacity=10**9, max_nodes=1024)),
    ]
    header = (f"{'configuration':<38} {'nodes':>7} {'propose':>8} {'observe':>8} {'begin+end':>9} {'total':>8} "
              f"{'(gc)':>7} {'%145ms':>7} {'%390ms':>7} {'p99':>7} {'max':>7} {'tree':>7} {'prune':>7} "
              f"{'accepted':>8}")
    print()
    print(header)
    print("-" * len(header))
    results = {}
    for label, kw in configs:
        trie = FrequencyTrie(**kw)
        run_requests(trie, warm, args.budget, timed=False, rid0=0)
        with GCClock() as gc_clock:
            r = run_requests(trie, measured, args.budget, timed=True, rid0=10_000)
        steps = len(r["propose_ns"])
        if label == SELECTION_ON:  # selection through pygtrie's public API vs the child index, same trie
            contexts = [tuple(p + a[:i]) for p, a in measured[:12] for i in range(0, len(a), 7)]
            selection = (len(trie), len(contexts), compare_selection(trie, contexts, args.budget))
        prunes = (trie.tree_prunes, trie.global_prunes)  # made by the run, before the timed ones below
        sizes = trie.tree_sizes()  # one prune of the warmed trie's largest tree, timed
        largest = max(sizes, key=sizes.get)
        t0 = CLOCK()
        tree_pruned = trie.prune(int(sizes[largest] * trie.prune_to), first_token=largest)
        tree_prune_ms = (CLOCK() - t0) / 1e6
        t0 = CLOCK()
        pruned = trie.prune(int(len(trie) * trie.prune_to))  # one global prune of the warmed trie, timed
        prune_ms = (CLOCK() - t0) / 1e6
        per_step = [p + o for p, o in zip(r["propose_ns"], r["observe_ns"])]
        amortized = (r["begin_ns"] + r["end_ns"]) / steps
        total_us = (sum(per_step) / steps + amortized) / 1e3
        row = dict(config=label, nodes=len(trie), steps=steps, propose_us=statistics.mean(r["propose_ns"]) / 1e3,
                   observe_us=statistics.mean(r["observe_ns"]) / 1e3, p99_step_us=pct(per_step, 0.99) / 1e3,
                   begin_end_per_step_us=amortized / 1e3, total_per_step_us=total_us,
                   frac_one_token_step=total_us / 1e3 / ONE_TOKEN_STEP_MS, frac_tree_step=total_us / 1e3 / TREE_STEP_MS,
                   mean_accepted=sum(r["accepts"]) / steps, begin_ms_per_request=r["begin_ns"] / r["requests"] / 1e6,
                   prunes=trie.prunes, gc_per_step_us=gc_clock.ns / steps / 1e3, gc_collections=gc_clock.collections,
                   max_step_us=max(per_step) / 1e3, prune_ms=prune_ms, prune_removed=pruned,
                   tree_prune_ms=tree_prune_ms, tree_prune_size=sizes[largest], tree_prune_removed=tree_pruned,
                   trees=len(sizes), tree_prunes=prunes[0], global_prunes=prunes[1])
        results[label] = row
        del trie  # a live trie would make every later configuration's garbage collections slower
        print(f"{label:<38} {row['nodes']:>7} {row['propose_us']:>6.0f}us {row['observe_us']:>6.0f}us "
              f"{row['begin_end_per_step_us']:>7.0f}us {row['total_per_step_us']:>6.0f}us {row['gc_per_step_us']:>5.0f}us "
              f"{100 * row['frac_one_token_step']:>6.2f}% {100 * row['frac_tree_step']:>6.2f}% "
              f"{row['p99_step_us'] / 1e3:>5.1f}ms {row['max_step_us'] / 1e3:>5.1f}ms {row['tree_prune_ms']:>5.1f}ms "
              f"{row['prune_ms']:>5.0f}ms "
              f"{row['mean_accepted']:>8.2f}")
        if args.json:
            print(json.dumps(row))
    print("\npropose/observe: mean per step; begin+end: per-request prompt insertion and elimination spread over the "
          "request's steps;\ntotal: their sum per step, of which (gc) was Python's garbage collector; %145ms / %390ms: "
          "total as a share of a\none-token / 16-token Qwen2.5-0.5B step; p99 / max: propose + observe of one step; "
          "tree: one prune of the warmed trie's\nlargest first-token tree to prune_to x its size; prune: one global "
          "prune of the warmed trie to prune_to x its size;\naccepted: simulated tokens committed per step "
          "(1.00 = plain decoding).")
    for label, row in results.items():
        print(f"  {label}: begin() {row['begin_ms_per_request']:.1f} ms per {args.prompt_tokens}-token prompt, "
              f"{row['trees']} trees, {row['tree_prunes']} tree prunes + {row['global_prunes']} global prunes; "
              f"timed: tree prune {row['tree_prune_removed']} of {row['tree_prune_size']} nodes, "
              f"global prune {row['prune_removed']} nodes")

    nodes, n_contexts, cmp = selection
    print(f"\nretrieval on the warmed '{SELECTION_ON}' trie ({nodes} nodes), {n_contexts} contexts, budget {args.budget}:")
    print(f"  child index (FrequencyTrie.retrieve): {cmp['child_index_us']:.0f} us mean, "
          f"{cmp['child_index_p99_us']:.0f} us p99")
    print(f"  pygtrie.Trie.traverse selection:     {cmp['pygtrie_traverse_us']:.0f} us mean, "
          f"{cmp['pygtrie_traverse_p99_us']:.0f} us p99")
    if args.json:
        print(json.dumps(dict(selection=cmp, nodes=nodes)))

    n_nodes, per_node = bytes_per_node(streams)
    default_max = FrequencyTrie().max_nodes
    print(f"\nmemory: {per_node:.0f} bytes per node (tracemalloc, a {n_nodes}-node trie); the default max_nodes "
          f"{default_max} is {default_max * per_node / 2**20:.0f} MiB")
    if args.json:
        print(json.dumps(dict(bytes_per_node=per_node, nodes=n_nodes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
