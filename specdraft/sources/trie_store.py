"""The frequency trie's node store: counted token windows in flat lists, bounded by pruning.

A :class:`NodeStore` holds every distinct prefix of the windows inserted into it as a node with
two counts, ``out`` (output windows through it) and ``prompt`` (prompt windows through it), and
the clock of the last window that touched it (``stamp``, the tie-break: among equally frequent
nodes the stalest is pruned first and the newest drafted first). Its frequency is
``out + prompt_weight * prompt``. Because a window through a node passes through all its
ancestors, a parent's counts are never below the sum of its children's: frequencies shrink going
down, so "the least frequent nodes" is always closed under descendants once ties go deepest-first,
and pruning them keeps the key set prefix-closed.

Two parts. Each count is the sum of a *shared* part (``shared_out``, ``shared_prompt``, with its
own clock in ``shared_stamp``), what finished requests and insertions taught, and a *running* part,
what the requests still running taught so far. Retrieval reads the sums, so every running request
drafts from everything at the cost of one store. The shared part changes only through
:meth:`add_shared` and the shared prunes; a running request's windows are counted with
:meth:`add_running` and taken back with :meth:`take_back`, and neither touches the shared part
or its clock. So once a request's windows are taken back, the shared part is exactly what it would
be had the request never run, and so is everything the shared part decides later (its prunes rank
shared counts and shared stamps only). A node lives while either part holds a count; its
``stamp`` is the running clock of the last running window through it while it has a running
part (running stamps start at :data:`RUNNING_STAMPS`, past any shared stamp: what is being
learnt now counts as the most recent), its shared stamp otherwise.

Layout. A node is an int, an index into parallel lists (``token``, ``parent``, ``depth``, ``out``,
``prompt``, ``stamp``, ``born``, ``shared_out``, ``shared_prompt``, ``shared_stamp``,
``children``); ``children[n]`` is a dict ``token -> child`` (``None`` while the node has none). Ints
and dicts of ints are not tracked by Python's cyclic garbage collector, so a store of any size is a
handful of tracked objects: a full collection does not scan its nodes, and a node that goes makes no
garbage for the collector to find (a node object linked to its parent would be a reference cycle).
Node 0 is the root, the empty key. A removed node's index is reused by the next node made;
``born`` is the running clock when the node was made, so :meth:`take_back` can tell a node that
held a window's count from one made anew after a prune took the first.

Bounds. After :meth:`prune_if_needed` no first-token tree (the nodes whose key starts with a
given token, that token's node included) holds more than ``capacity`` shared nodes, and the store
holds at most ``max_nodes`` of them; the same two bounds hold for the nodes with only a running
part. Past ``capacity`` a tree loses its least frequent nodes down to ``prune_to * capacity``;
past ``max_nodes`` the store its globally least frequent, down to ``prune_to * max_nodes``. A
shared prune drops the shared part (a node with a running part stays, for the running requests),
a running prune the whole node. Only the trees that grew since the last check are looked at; a
tree's prune ranks only its own nodes, O(T log T).

Not thread-safe on its own: :class:`~specdraft.sources.trie.FrequencyTrie` guards it with its lock.
"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import Iterator, Sequence

__all__ = ["NodeStore", "ROOT", "RUNNING_STAMPS"]

#: The root node: the empty key, never counted.
ROOT = 0
#: ``parent`` of a removed node (its index waits in the free list).
_GONE = -2
#: Where the running clock starts: past any stamp the shared clock will reach.
RUNNING_STAMPS = 1 << 48


class NodeStore:
    """Counted windows in flat lists, in a shared and a running part (see the module docstring)."""

    def __init__(self, capacity: int, max_nodes: int, prompt_weight: float, prune_to: float) -> None:
        self.capacity = capacity
        self.max_nodes = max_nodes
        self.prompt_weight = prompt_weight
        self.prune_to = prune_to
        self.tree_watermark = min(capacity, int(capacity * prune_to))  #: where a tree's prune stops
        self.global_watermark = min(max_nodes, int(max_nodes * prune_to))  #: where a global prune stops
        self.prunes = 0  #: how many times the shared part was pruned (per tree or global)
        self.tree_prunes = 0  #: of which per-tree prunes (a tree past ``capacity``)
        self.global_prunes = 0  #: of which global prunes (the store past ``max_nodes``)
        self.pruned_nodes = 0  #: shared nodes pruned, in total
        self.running_prunes = 0  #: how many times nodes with only a running part were pruned
        self.version = 0  #: structural changes (nodes made or removed): when a view of the keys is stale
        self.clear()

    def clear(self) -> None:
        """Forget every node, both parts (the counters of past prunes stay)."""
        self.token, self.parent, self.depth, self.children = [-1], [-1], [0], [None]
        self.out, self.prompt, self.stamp, self.born = [0], [0], [0], [0]
        self.shared_out, self.shared_prompt, self.shared_stamp = [0], [0], [0]
        self._free: list[int] = []
        self.size = 0  #: nodes with a shared part
        self.tree_size: dict[int, int] = {}  #: first token -> its tree's nodes with a shared part
        self.running_size = 0  #: nodes with only a running part
        self.running_tree_size: dict[int, int] = {}  #: first token -> its tree's running-only nodes
        self._grown: set[int] = set()  # trees whose shared part grew since the last check
        self._running_grown: set[int] = set()  # trees whose running-only nodes grew since then
        self.clock = 0  #: the shared clock: the stamp of the last shared window
        self.tick = RUNNING_STAMPS  #: the running clock: running windows and node births
        self.version += 1

    # -- counting windows ----------------------------------------------------------------------

    def add_running(self, tokens: Sequence[int], start: int, stop: int, as_prompt: bool = False) -> int:
        """Count one window ``tokens[start:stop]`` in the running part of every node of its path,
        making the nodes it lacks; returns its running clock (what :meth:`take_back` needs)."""
        self.tick += 1
        tick = self.tick
        counts = self.prompt if as_prompt else self.out
        children, stamp = self.children, self.stamp
        node = ROOT
        i = start
        while i < stop:
            kids = children[node]
            child = kids.get(tokens[i]) if kids is not None else None
            if child is None:
                break
            counts[child] += 1
            stamp[child] = tick
            node = child
            i += 1
        if i < stop:  # below a missing node everything is missing: make the rest, counted once
            self._make(node, tokens, start, i, stop, as_prompt, False)
        return tick

    def add_shared(self, tokens: Sequence[int], start: int, stop: int, as_prompt: bool = False) -> None:
        """Count one window ``tokens[start:stop]`` in the shared part of every node of its path."""
        self.clock += 1
        self.tick += 1  # (the births of the nodes it makes)
        clock = self.clock
        counts, own = (self.prompt, self.shared_prompt) if as_prompt else (self.out, self.shared_out)
        out, prompt, shared_out, shared_prompt = self.out, self.prompt, self.shared_out, self.shared_prompt
        children, stamp, shared_stamp = self.children, self.stamp, self.shared_stamp
        node = ROOT
        i = start
        while i < stop:
            kids = children[node]
            child = kids.get(tokens[i]) if kids is not None else None
            if child is None:
                break
            if not shared_out[child] and not shared_prompt[child]:  # a running-only node joins the shared part
                self._count_sizes(tokens[start], 1, -1)
            counts[child] += 1
            own[child] += 1
            shared_stamp[child] = clock
            if out[child] == shared_out[child] and prompt[child] == shared_prompt[child]:
                stamp[child] = clock  # no running part: the shared stamp is the node's
            node = child
            i += 1
        if i < stop:
            self._make(node, tokens, start, i, stop, as_prompt, True)

    def add_all(self, tokens: Sequence[int], first: int, width: int, as_prompt: bool = False,
                shared: bool = True) -> int:
        """Count every window of ``tokens`` that starts at ``first`` or later: ``width`` tokens, or
        fewer where the tokens end (a window needs at least two tokens). Returns the running clock
        of the first window (running windows get consecutive clocks)."""
        n = len(tokens)
        add = self.add_shared if shared else self.add_running
        for start in range(first, n - 1):
            add(tokens, start, min(start + width, n), as_prompt)
        return self.tick - max(0, n - 1 - first) + 1

    def take_back(self, tokens: Sequence[int], start: int, stop: int, as_prompt: bool, tick: int) -> None:
        """Take the running count of the window ``tokens[start:stop]``, counted with running clock
        ``tick``, back from the nodes of its path that still hold it; a node left with no count goes,
        with what is below it (which held nothing but the rest of this window). A node made after
        ``tick`` never held it: a prune took the node that did, with its subtree, so the walk stops
        there."""
        counts = self.prompt if as_prompt else self.out
        out, prompt, shared_out, shared_prompt = self.out, self.prompt, self.shared_out, self.shared_prompt
        children, born = self.children, self.born
        node = ROOT
        for i in range(start, stop):
            kids = children[node]
            child = kids.get(tokens[i]) if kids is not None else None
            if child is None or born[child] > tick:
                return
            counts[child] -= 1
            if out[child] == shared_out[child] and prompt[child] == shared_prompt[child]:
                if not out[child] and not prompt[child]:  # it only held this window: so does what is below
                    self.remove(child, tokens[start])
                    return
                self.stamp[child] = self.shared_stamp[child]  # no running part left
            node = child

    def sort_free(self) -> None:
        """Sort the freed indexes, so that the last ones form runs of consecutive indexes for new
        chains to take (see :meth:`_make`). Cheap on a list of sorted runs; worth it after many
        nodes went (a request's counts taken back)."""
        self._free.sort()

    def _make(self, node: int, tokens: Sequence[int], start: int, first: int, stop: int, as_prompt: bool,
              shared: bool) -> None:
        """Make the nodes of ``tokens[first:stop]`` below ``node`` (the node of
        ``tokens[start:first]``), each counted once, in the shared part or the running part.

        Where the last freed indexes are a run of consecutive ones (see :meth:`sort_free`), a new
        chain takes them with one slice assignment per list, as cheap as appending. Otherwise new
        indexes are appended, unless freed ones are more than half of all: then they are taken one
        by one (three times slower per node), so the lists never hold more than twice the nodes."""
        made = stop - first
        fields = self._fields(as_prompt, shared)
        free = self._free
        run = free[-made:]
        if len(run) == made and run[-1] - run[0] == made - 1 and run == [*range(run[0], run[0] + made)]:
            del free[-made:]
            self._place(node, tokens[first:stop], fields, run[0])
        else:
            if 2 * len(free) > len(self.token):
                node, first = self._reuse(node, tokens, first, stop, fields)
            if first < stop:
                self._place(node, tokens[first:stop], fields, len(self.token))
        self._count_sizes(tokens[start], made if shared else 0, 0 if shared else made)
        self.version += 1

    def _fields(self, as_prompt: bool, shared: bool) -> tuple[int, int, int, int, int, int, int]:
        """A new node's out, prompt, stamp, born, shared out, shared prompt and shared stamp."""
        out, prompt = (0, 1) if as_prompt else (1, 0)
        if shared:
            return out, prompt, self.clock, self.tick, out, prompt, self.clock
        return out, prompt, self.tick, self.tick, 0, 0, 0

    def _reuse(self, node: int, tokens: Sequence[int], first: int, stop: int,
               fields: tuple[int, ...]) -> tuple[int, int]:
        """Make the nodes of ``tokens[first:stop]`` below ``node`` in freed indexes, one by one,
        while there are; returns the last node made and where it stopped."""
        free, token, parent, depth, children = self._free, self.token, self.parent, self.depth, self.children
        out, prompt, stamp, born = self.out, self.prompt, self.stamp, self.born
        shared_out, shared_prompt, shared_stamp = self.shared_out, self.shared_prompt, self.shared_stamp
        f_out, f_prompt, f_stamp, f_born, f_shared_out, f_shared_prompt, f_shared_stamp = fields
        level = depth[node]
        while free and first < stop:
            child = free.pop()
            t = tokens[first]
            level += 1
            token[child] = t
            parent[child] = node
            depth[child] = level
            children[child] = None
            out[child] = f_out
            prompt[child] = f_prompt
            stamp[child] = f_stamp
            born[child] = f_born
            shared_out[child] = f_shared_out
            shared_prompt[child] = f_shared_prompt
            shared_stamp[child] = f_shared_stamp
            kids = children[node]
            if kids is None:
                children[node] = {t: child}
            else:
                kids[t] = child
            node = child
            first += 1
        return node, first

    def _place(self, parent: int, new: Sequence[int], fields: tuple[int, ...], child: int) -> None:
        """Make a chain of nodes for the tokens ``new`` below ``parent`` at the consecutive indexes
        from ``child`` (freed ones, or, from the lists' end, new ones)."""
        n = len(new)
        end = child + n
        level = self.depth[parent]
        kids = self.children[parent]
        if kids is None:
            self.children[parent] = {new[0]: child}
        else:
            kids[new[0]] = child
        runs: dict[int, list[int]] = {}  # (one list per distinct value: most fields are 0 or the clock)
        values = [(self.token, new), (self.parent, [parent, *range(child, end - 1)]),
                  (self.depth, range(level + 1, level + n + 1)),
                  (self.children, [*[{t: c} for t, c in zip(new[1:], range(child + 1, end))], None])]
        for column, value in zip((self.out, self.prompt, self.stamp, self.born, self.shared_out,
                                  self.shared_prompt, self.shared_stamp), fields):
            run = runs.get(value)
            if run is None:
                run = runs[value] = [value] * n
            values.append((column, run))
        if child == len(self.token):
            for column, value in values:
                column.extend(value)
        else:
            for column, value in values:
                column[child:end] = value

    def _count_sizes(self, tree: int, shared: int, running: int) -> None:
        """``shared`` more nodes with a shared part in ``tree`` and ``running`` more running-only ones
        (either may be negative)."""
        if shared:
            self.size += shared
            _resize(self.tree_size, self._grown, tree, shared)
        if running:
            self.running_size += running
            _resize(self.running_tree_size, self._running_grown, tree, running)

    # -- reading -------------------------------------------------------------------------------

    def find(self, tokens: Sequence[int], start: int, stop: int) -> int:
        """The node of the key ``tokens[start:stop]``, or -1 if the store lacks it."""
        children = self.children
        node = ROOT
        for i in range(start, stop):
            kids = children[node]
            node = kids.get(tokens[i], -1) if kids is not None else -1
            if node < 0:
                return -1
        return node

    def is_shared(self, node: int) -> bool:
        """Whether the node has a shared part."""
        return bool(self.shared_out[node] or self.shared_prompt[node])

    def first_token(self, node: int) -> int:
        """The first token of ``node``'s key: the tree it belongs to."""
        parent = self.parent
        while parent[node] != ROOT:
            node = parent[node]
        return self.token[node]

    def subtree(self, top: int) -> list[int]:
        """``top`` and every node below it, parents before children."""
        children = self.children
        nodes = []
        stack = [top]
        while stack:
            n = stack.pop()
            nodes.append(n)
            kids = children[n]
            if kids:
                stack.extend(kids.values())
        return nodes

    def items(self, shared_only: bool = False) -> Iterator[tuple[tuple[int, ...], int]]:
        """``(key, node)`` for every node (with ``shared_only``, every node with a shared part),
        parents before children."""
        children, shared_out, shared_prompt = self.children, self.shared_out, self.shared_prompt
        stack: list[tuple[tuple[int, ...], int]] = [((), ROOT)]
        while stack:
            key, node = stack.pop()
            kids = children[node]
            if kids:
                for t, child in kids.items():
                    child_key = key + (t,)
                    if not shared_only or shared_out[child] or shared_prompt[child]:
                        yield child_key, child
                    stack.append((child_key, child))

    # -- removing ------------------------------------------------------------------------------

    def remove(self, node: int, tree: int | None = None) -> int:
        """Remove ``node`` and its subtree, both parts; returns the number of nodes removed. ``tree``:
        the node's first token, if known."""
        if tree is None:
            tree = self.first_token(node)
        children, parents, free, shared_out, shared_prompt = (self.children, self.parent, self._free,
                                                              self.shared_out, self.shared_prompt)
        kids = children[parents[node]]
        del kids[self.token[node]]  # type: ignore[union-attr]
        if not kids:
            children[parents[node]] = None
        gone = shared = 0
        stack = [node]
        while stack:
            n = stack.pop()
            kids = children[n]
            if kids:
                stack.extend(kids.values())
            children[n] = None
            parents[n] = _GONE
            free.append(n)
            gone += 1
            if shared_out[n] or shared_prompt[n]:
                shared += 1
        self._count_sizes(tree, -shared, shared - gone)
        self.version += 1
        return gone

    # -- pruning (Sec. 4.3.1, node pruning) -----------------------------------------------------

    def prune_if_needed(self) -> None:
        """After every change that may add nodes: bound the shared part, then the running-only
        nodes (the shared part's drops may leave running-only nodes)."""
        self.bound(shared=True)
        self.bound(shared=False)

    def bound(self, shared: bool) -> None:
        """Prune the shared part (``shared``) or the nodes with only a running part: each tree that
        grew since the last check past ``capacity``, then the whole part if past ``max_nodes``."""
        grown = self._grown if shared else self._running_grown
        sizes = self.tree_size if shared else self.running_tree_size
        over = [t for t in grown if sizes.get(t, 0) > self.capacity]
        grown.clear()
        for t in over:
            self.prune(self.tree_watermark, t, shared)
        if (self.size if shared else self.running_size) > self.max_nodes:
            self.prune(self.global_watermark, shared=shared)

    def prune(self, target: int, tree: int | None = None, shared: bool = True) -> int:
        """Prune the least frequent nodes of the first-token tree ``tree`` (of the whole store with
        ``None``) until ``target`` remain in its shared part (``shared``) or among its nodes with
        only a running part; returns how many nodes were pruned. O(N log N) in the nodes looked at.

        The least frequent go first (by frequency, then deepest first, then stalest stamp:
        descendants first, so the key set stays prefix-closed), ranked by the shared counts and
        stamps for the shared part, by the counts and stamps of the running-only nodes otherwise
        (a running-only node's descendants are running-only). A shared victim with a running part
        stays as a running-only node; every other victim goes, with its descendants, all victims
        too."""
        w, depth, out, prompt, stamp = self.prompt_weight, self.depth, self.out, self.prompt, self.stamp
        s_out, s_prompt, s_stamp = self.shared_out, self.shared_prompt, self.shared_stamp
        sizes = self.tree_size if shared else self.running_tree_size
        total = self.size if shared else self.running_size
        size = total if tree is None else sizes.get(tree, 0)
        if size <= target:
            return 0
        if tree is None:
            nodes = self.subtree(ROOT)[1:]
        else:
            nodes = self.subtree(self.children[ROOT][tree])  # type: ignore[index]
        if shared:
            ranked = [(s_out[n] + w * s_prompt[n], -depth[n], s_stamp[n], n)
                      for n in nodes if s_out[n] or s_prompt[n]]
        else:
            ranked = [(out[n] + w * prompt[n], -depth[n], stamp[n], n)
                      for n in nodes if not s_out[n] and not s_prompt[n]]
        victims = [entry[3] for entry in _least(ranked, size - target)]
        doomed = set()
        for n in victims:
            if not shared or (out[n] == s_out[n] and prompt[n] == s_prompt[n]):
                doomed.add(n)
                continue
            out[n] -= s_out[n]  # (it has a running part: it stays, running only)
            prompt[n] -= s_prompt[n]
            s_out[n] = s_prompt[n] = s_stamp[n] = 0
            self._count_sizes(self.first_token(n) if tree is None else tree, -1, 1)
        tops = [n for n in doomed if self.parent[n] not in doomed]  # (before any goes: removal unlinks)
        removed = sum(self.remove(n, tree) for n in tops)
        assert removed == len(doomed), "pruned set was not closed under descendants"
        if shared:
            self.prunes += 1
            self.pruned_nodes += len(victims)
            self.version += 1
            if tree is None:
                self.global_prunes += 1
            else:
                self.tree_prunes += 1
        else:
            self.running_prunes += 1
        return len(victims)

    # -- checks --------------------------------------------------------------------------------

    def check(self) -> dict[tuple[int, ...], int]:
        """Assert the structural invariants (O(size); for tests) and return ``key -> node`` of the
        shared nodes: links agree, both parts are >= 0 and every node holds a count, a parent's
        counts (each part) are at least the sum of its children's, the stamps follow the parts,
        tree sizes are right and within the bounds, and no removed index is reachable."""
        nodes = list(self.items())
        for key, node in nodes:
            self._check_node(key, node)
        keys = {key: node for key, node in nodes if self.is_shared(node)}
        per_tree = Counter(key[0] for key in keys)
        running_tree = Counter(key[0] for key, node in nodes if not self.is_shared(node))
        assert len(keys) == self.size, f"size {self.size} but {len(keys)} shared nodes reachable"
        assert len(nodes) - len(keys) == self.running_size, f"running size {self.running_size} is off"
        assert len(nodes) + len(self._free) + 1 == len(self.token), "a node index is neither used nor free"
        assert per_tree == self.tree_size, "per-tree shared node counts are off"
        assert running_tree == self.running_tree_size, "per-tree running node counts are off"
        for sizes in (per_tree, running_tree):
            assert all(n <= self.capacity for n in sizes.values()), f"a tree holds more than {self.capacity} nodes"
            assert sum(sizes.values()) <= self.max_nodes, f"more than max_nodes {self.max_nodes} nodes"
        return keys

    def _check_node(self, key: tuple[int, ...], node: int) -> None:
        out, prompt, s_out, s_prompt = self.out, self.prompt, self.shared_out, self.shared_prompt
        assert self.parent[node] != _GONE, f"removed node {node} reachable under {key}"
        assert self.token[node] == key[-1] and self.depth[node] == len(key), f"node {node} under {key}"
        assert 0 <= s_out[node] <= out[node] and 0 <= s_prompt[node] <= prompt[node], f"parts at {key}"
        assert out[node] + prompt[node] > 0, f"zero-frequency node kept at {key}"
        if out[node] != s_out[node] or prompt[node] != s_prompt[node]:  # a running part
            assert self.stamp[node] > RUNNING_STAMPS, f"running part without a running stamp at {key}"
        else:
            assert self.stamp[node] == self.shared_stamp[node] <= self.clock, f"stale stamp at {key}"
        kids = self.children[node]
        assert kids is None or kids, f"empty child dict kept at {key}"
        if kids:
            assert all(self.parent[c] == node for c in kids.values()), f"child links disagree at {key}"
            for column in (out, prompt, s_out, s_prompt):
                assert column[node] >= sum(column[c] for c in kids.values()), f"counts grow going down at {key}"
            assert all(self.born[c] >= self.born[node] for c in kids.values()), f"born before its parent at {key}"


def _resize(sizes: dict[int, int], grown: set[int], tree: int, change: int) -> None:
    """``change`` more nodes in ``tree`` (fewer if negative): a tree left with none leaves ``sizes``,
    one that grew joins ``grown`` (the trees the next bound looks at)."""
    left = sizes.get(tree, 0) + change
    if left:
        sizes[tree] = left
    else:
        del sizes[tree]
    if change > 0:
        grown.add(tree)


def _least(ranked: list[tuple[float, int, int, int]], excess: int) -> list[tuple[float, int, int, int]]:
    """The ``excess`` smallest of ``ranked`` (all of them if fewer)."""
    if excess >= len(ranked):
        return ranked
    if 4 * excess < len(ranked):
        return heapq.nsmallest(excess, ranked)
    ranked.sort()
    return ranked[:excess]
