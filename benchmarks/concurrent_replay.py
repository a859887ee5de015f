"""Mean accepted tokens per step on recorded greedy outputs with C requests running at a time.

Sources that learn across requests (the trie, the suffix tree's global cache, a shared n-gram)
help a request with what the others taught them; how soon a running request's learning reaches
the others (at once, or when it ends) matters most when many run together. This replays the
recordings ``budget_replay.py export`` wrote (prompt and reference output token ids), no model:
up to C requests at a time, one step each in turn, every step the sources' drafts merged by the
decoder's own ``TokenTree.from_drafts`` and walked along the reference (the accepted path plus the
model's own next token), then ``observe``; a request that reaches its reference's end ``end`` s and
the next one begins. Prints tokens per step for C = 1, 4, 16.

    python benchmarks/concurrent_replay.py benchmarks/results/merge-replay-bf16-2026-11-26/humaneval.json.gz
"""
import gzip, json, sys
from specdraft.sources import Context, Feedback, registry
from specdraft.tree import TokenTree

def walk(tree, full, done):
    node, step = 0, []
    while done + len(step) < len(full):
        token = full[done + len(step)]; step.append(token)
        child = tree.child(node, token)
        if child is None: break
        node = child
    return step

def run(paths, concurrency, budget=32, specs=None):
    sources = registry.make_sources(specs or list(registry.DEFAULT_SOURCES))
    records = [r for p in paths for r in json.load(gzip.open(p))["records"]]
    queue = list(enumerate(records)); live = {}; steps = tokens = 0
    while queue or live:
        while queue and len(live) < concurrency:
            rid, r = queue.pop(0)
            full = list(r["prompt_ids"]) + list(r["reference"]); toks = list(r["prompt_ids"])
            c = Context(tuple(toks), len(toks), rid)
            for s in sources: s.begin(c)
            live[rid] = (full, toks, len(toks))
        for rid in list(live):
            full, toks, pl = live[rid]
            c = Context(tuple(toks), pl, rid)
            depth = len(full) - len(toks) - 1
            drafts = [[b[:depth] for b in s.propose(c, budget).branches if b] if depth > 0 else [] for s in sources]
            step = walk(TokenTree.from_drafts(c.root, drafts, budget), full, len(toks))
            toks.extend(step); steps += 1; tokens += len(step)
            c = Context(tuple(toks), pl, rid)
            for s in sources: s.observe(Feedback(committed=step, context=c))
            if len(toks) >= len(full):
                for s in sources: s.end(c)
                del live[rid]
    return tokens / steps

if __name__ == "__main__":
    specs = None
    paths = [a for a in sys.argv[1:] if not a.startswith("--sources=")]
    for a in sys.argv[1:]:
        if a.startswith("--sources="):
            specs = registry.parse_source_names(a.split("=", 1)[1])
    for path in paths:
        print(path, " ".join(f"C={c}: {run([path], c, specs=specs):.4f}" for c in (1, 4, 16)), flush=True)
