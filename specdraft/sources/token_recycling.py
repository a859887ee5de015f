"""Token Recycling (Luo et al., ACL 2025, arXiv 2408.08696): draft from the model's own discarded top-k.

Every forward pass computes a distribution over the vocabulary at every row, and decoding keeps
one token of it. The paper's observation (Sec. 1, Fig. 1) is that the other high-probability
candidates -- the "trash" -- often turn up a few steps later. So the source keeps, for every token
of the vocabulary, the ``k`` most likely tokens the model last predicted after it, in an
*adjacency matrix* ``M[vocab, k]`` (Sec. 3.1, "Adjacency Matrix Initialization"), and drafts a tree
by breadth-first search over that matrix from the root along a fixed *tree template* (Sec. 3.2,
"Draft Tree Retrieval"). After each step, every row the forward computed -- the root and every
tree node, accepted or not -- overwrites its input token's row with its new top-k (Sec. 3.3,
"Adjacency Matrix Update": the latest candidates replace the old ones). The matrix is never
cleared between requests (the paper's *hot start*, Sec. 3.1 / Sec. 4 ablation), so what one
answer taught it helps the next.

Where each part of the paper lives here:

=====================================  ======================================================
paper                                  this module
=====================================  ======================================================
3.1 adjacency matrix, hot start        ``TokenRecycling._matrix`` (int32, ``-1`` = empty),
                                       kept across requests; :meth:`~TokenRecycling.reset`
                                       gives the cold start of the ablation
3.2 BFS along a static tree template   :meth:`TokenRecycling.propose`, one numpy gather per
                                       tree level; :class:`TreeTemplate`
3.3 update with the latest top-k       :meth:`TokenRecycling.observe`, one fancy-index
                                       assignment per step
4   default template (80 nodes, k=8)   ``TEMPLATES["tr80"]``, the authors' version "2.2.2"
=====================================  ======================================================

Templates. A template is a tree over *ranks*: node ``i`` is ``(parent, rank)`` -- take the
``rank``-th candidate of the parent's token (``parent = -1`` is the root). The authors'
implementation (``Luowaterbi/TokenRecycling``, ``model/recycling/tree_template_.py``) writes it as
rank paths (``[0, 1]`` = the 1st candidate of the root's 0th candidate) and orders it level by
level. Level order is wrong for us: ``propose`` keeps the first ``budget`` nodes of the template,
so a budget of 16 would keep all eight depth-1 nodes, ranks 4 to 7 included, and drop the top-1
chain at depth 3. (The decoder's merge then ranks what was proposed by calibrated value,
:meth:`specdraft.tree.TokenTree.from_drafts`, starting from the same prior as below.) So the named templates list
the paper's 80 nodes *best first*, by a prior acceptance score ``prod(0.5 / (rank + 1))`` along
the path (a top-1 candidate is right about half the time, and rank ``r`` about ``1/(r+1)`` as often
as rank 0; ties go to the shallower node, then to the paper's order). This Zipf-like prior is
also the paper's own heuristic ("more children for higher-ranked nodes", Sec. 3.2): at depth 2
the paper's template is exactly the nodes with ``(r1 + 1)(r2 + 1) <= 9``. The score of a child
is strictly below its parent's, so the order puts parents first, and every prefix of it is a
tree: ``tr8``, ``tr16`` and ``tr32`` are the first 8, 16 and 32 nodes of ``tr80``, sized for CPU
widths where every extra row costs. The order is a prior, not a measurement; a template measured
on real acceptance can be passed as an explicit list of ``(parent, rank)`` pairs.

Drafting. ``propose`` lists one root-to-node token path per template node that exists, in the
template's order, so the budget cuts the least likely nodes first. A node whose matrix entry is
empty (the parent token was never seen as a forward's input) is skipped with its whole subtree.
Because a row's top-k ids are distinct, sibling paths are distinct too.

Update rule and duplicates. A step's rows often share an input token (the same token at two tree
nodes, or the root again in the tree). The rows are applied as if one after another in row order,
so the *last* row with a given token wins; it is done as one vectorised assignment over the last
occurrence of each token (``np.unique`` on the reversed rows), because numpy does not promise an
order for repeated indices in a fancy assignment. The paper's implementation does the same
assignment on a GPU, where the winner among duplicates is unspecified. Rows of rejected tree
nodes update the matrix too, as in the paper: their context was wrong, but their top-k is still
what the model thinks follows that token.

Memory. ``vocab * k * 4`` bytes: 151936 x 8 x 4 = 4.9 MB (4.6 MiB) for Qwen2.5's vocabulary
(the paper's Vicuna/Llama vocabulary of 32000 at k=8: 1.0 MB in int32; the paper quotes 1.95 MB for
int64). Without ``vocab_size`` the matrix starts empty and grows to cover the largest token seen
(in ``row_tokens`` or ``top_ids``), by at least half its size each time and in steps of 1024 rows,
so it is copied O(log vocab) times and overshoots the vocabulary by at most half (about 7 MB at
most for Qwen2.5). With ``vocab_size`` it is allocated once, and any token id outside it is an
error. Beside it, 4 bytes per row (0.6 MB for Qwen2.5) record which running request wrote each row
last, and a running request logs the rows it overwrites (their old content, ``k * 4 + 12`` bytes a
row, at most twice per row it touched): what :meth:`TokenRecycling.abort` puts back when a request
fails.

Cost. ``propose`` is one gather per template level (6 for ``tr80``; an empty parent, ``-1``, reads
an always-empty sentinel row kept after the last, so no masking is needed) plus building the paths
in Python; ``observe`` is a ``np.unique`` over the step's rows and one assignment. Measured with
``timeit`` on one CPU thread, Qwen2.5-sized vocabulary (151936), k=8, ``tr80``, a warm matrix where
all 80 nodes exist: ``propose`` 20 us at budget 80 (9 of them the gathers), 12 us at budget 8;
``observe`` of 81 rows 13 us (up to twice that on a loaded machine). That is about 0.02% of a
150-200 ms Qwen2.5-0.5B CPU step, far inside the paper's "<2% overhead" target. The top-k itself is
taken by the decoder (one ``torch.topk`` per step for all sources that ask).

Thread safety. One lock guards the matrix: ``observe`` writes and ``propose`` reads it whole
inside the lock (the BFS reads one consistent snapshot, never a half-written row), so one source
may serve several decoders on the same vocabulary in several threads. Pickling and ``deepcopy``
copy the matrix under the lock and give the copy a new lock.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Sequence, Union

import numpy as np

from ..checks import check_int
from .base import Context, Draft, Feedback, SourceBase

__all__ = ["DEFAULT_TEMPLATE", "PAPER_TREE_PATHS", "TEMPLATES", "TokenRecycling", "TreeTemplate"]

#: The authors' default tree, version "2.2.2" of ``tree_template_.py``: 80 rank paths from the
#: root, in their (level) order. ``[0, 1]`` = the 1st candidate of the root's 0th candidate.
PAPER_TREE_PATHS: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,),
    (0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (0, 6), (0, 7), (1, 0), (1, 1), (1, 2), (1, 3),
    (2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (4, 0), (5, 0), (6, 0), (7, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 0, 4), (0, 0, 5), (0, 0, 6), (0, 0, 7), (0, 1, 0),
    (0, 1, 1), (0, 1, 2), (0, 2, 0), (0, 2, 1), (0, 3, 0), (0, 4, 0), (0, 5, 0), (0, 6, 0), (0, 7, 0),
    (1, 0, 0), (1, 0, 1), (1, 1, 0), (2, 0, 0), (3, 0, 0), (4, 0, 0), (5, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 0, 3), (0, 0, 0, 4), (0, 0, 1, 0), (0, 0, 1, 1),
    (0, 0, 2, 0), (0, 0, 3, 0), (0, 0, 4, 0), (0, 1, 0, 0), (0, 2, 0, 0), (1, 0, 0, 0), (2, 0, 0, 0),
    (3, 0, 0, 0),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (0, 0, 0, 0, 2), (0, 0, 0, 1, 0), (0, 0, 0, 2, 0), (0, 0, 1, 0, 0),
    (0, 1, 0, 0, 0), (1, 0, 0, 0, 0),
    (0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 1), (0, 0, 0, 1, 0, 0),
)

#: Prior acceptance of a rank-0 candidate in the best-first order of the named templates.
_TOP1_PRIOR = Fraction(1, 2)


def _prior_score(path: Sequence[int]) -> Fraction:
    """``prod(0.5 / (rank + 1))``: a Zipf-like prior on how often the node is accepted (exact, so
    ties are ties)."""
    return math.prod((_TOP1_PRIOR / (rank + 1) for rank in path), start=Fraction(1))


@dataclass(frozen=True)
class TreeTemplate:
    """A static draft tree over ranks: node ``i`` takes the ``ranks[i]``-th candidate of node
    ``parents[i]``'s token (``-1`` = the root). Parents come before their children, and the order
    of the nodes is the order drafts are listed in (best first), so any prefix is a tree.

    Build one with :meth:`from_pairs` (``[(parent, rank), ...]``), :meth:`from_paths` (the
    authors' rank paths), or take one of :data:`TEMPLATES`; the constructor is not meant to be called directly.
    """

    parents: tuple[int, ...]
    ranks: tuple[int, ...]
    name: str = "custom"

    # --- construction -----------------------------------------------------------------------

    @classmethod
    def from_pairs(cls, pairs: Sequence[Sequence[int]], name: str = "custom") -> "TreeTemplate":
        """A template from ``(parent_index, rank)`` pairs; ``parent_index`` is ``-1`` for a child of
        the root, else the index of an *earlier* pair. Raises ``ValueError`` naming the bad pair."""
        if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence) or len(pairs) == 0:
            raise ValueError(f"a tree template must be a non-empty list of (parent_index, rank) pairs, got {pairs!r}")
        nodes: dict[tuple[int, int], None] = {}  # (parent, rank) in order; a dict finds a repeat at once
        for i, pair in enumerate(pairs):
            if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2 \
                    or not all(_is_int(v) for v in pair):
                raise ValueError(f"tree template node {i} is {pair!r}; each node must be a pair of ints "
                                 "(parent_index, rank)")
            parent, rank = int(pair[0]), int(pair[1])
            if not -1 <= parent < i:
                raise ValueError(f"tree template node {i} is {pair!r}: its parent_index must be -1 (the root) "
                                 f"or an earlier node, 0..{i - 1}; parents come before their children")
            if rank < 0:
                raise ValueError(f"tree template node {i} is {pair!r}: rank must be >= 0")
            if (parent, rank) in nodes:
                raise ValueError(f"tree template node {i} is {pair!r}, which an earlier node already is; "
                                 "each (parent_index, rank) may appear once")
            nodes[parent, rank] = None
        parents, ranks = zip(*nodes)
        return cls(parents, ranks, name)

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]], name: str = "custom",
                   best_first: bool = False) -> "TreeTemplate":
        """A template from rank paths as the authors write them (``[0, 1]`` = the 1st candidate of
        the root's 0th candidate). Every path's prefix must be in the list. The nodes keep the
        list's order, made parents-first; with ``best_first`` they are sorted by the prior score
        (see the module docstring) instead."""
        keyed = [tuple(int(r) for r in p) for p in paths]
        if not keyed or any(len(p) == 0 for p in keyed):
            raise ValueError(f"a tree template needs non-empty rank paths, got {paths!r}")
        known = set(keyed)
        if len(known) != len(keyed):
            raise ValueError(f"tree template paths repeat a path: {paths!r}")
        for p in keyed:
            if len(p) > 1 and p[:-1] not in known:
                raise ValueError(f"tree template path {list(p)} has no parent {list(p[:-1])} in the list")
        # (sorts are stable: ties keep the list's order)
        if best_first:
            keyed.sort(key=lambda p: (-_prior_score(p), len(p)))
        else:  # by depth: parents first, the list's order otherwise
            keyed.sort(key=len)
        index = {p: i for i, p in enumerate(keyed)}
        return cls.from_pairs([(index.get(p[:-1], -1), p[-1]) for p in keyed], name)

    # --- derived ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def max_rank(self) -> int:
        return max(self.ranks)

    @property
    def depths(self) -> tuple[int, ...]:
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return tuple(depths)

    def prefix(self, n: int, name: str | None = None) -> "TreeTemplate":
        """The first ``n`` nodes (a tree, since parents come first)."""
        return TreeTemplate(self.parents[:n], self.ranks[:n], name or f"{self.name}[:{n}]")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


_TR80 = TreeTemplate.from_paths(PAPER_TREE_PATHS, name="tr80", best_first=True)

#: Named templates: the paper's 80-node tree in best-first order, and its best-first prefixes
#: for CPU widths (see the module docstring).
TEMPLATES: dict[str, TreeTemplate] = {
    "tr8": _TR80.prefix(8, "tr8"),
    "tr16": _TR80.prefix(16, "tr16"),
    "tr32": _TR80.prefix(32, "tr32"),
    "tr80": _TR80,
}

#: The default: the 16-node prefix of the paper's tree. On a CPU the adaptive budget rarely checks
#: more than ~16 nodes, and in a 10-prompt MT-Bench grid (bf16, 96 tokens, all four templates
#: interleaved) it had the best median and geomean speed-up; the numbers are in the docs.
DEFAULT_TEMPLATE = "tr16"

#: Rows are added in multiples of this when the matrix grows lazily.
_GROW_ROWS = 1024

TemplateArg = Union[str, TreeTemplate, Sequence[Sequence[int]]]


@dataclass(slots=True)
class _Undo:
    """What one begun request overwrote in the matrix, to put it back if the request fails.

    The matrix keeps, per row, the serial of the begun request that wrote it last
    (``TokenRecycling._writer``; 0: none, or a write outside a begun request). Before a request
    writes a row whose last writer is not itself -- its first write to the row, or the first after
    another request wrote it -- it logs the row's content and last writer: the row's state before
    this *run* of its writes. A request that overwrites the same rows step after step logs each row
    once (one fancy-index read per step, of the rows it had not written last). The latest entry of
    a row is the one to put back; :meth:`compact` keeps only those, and runs when the log doubles
    (only when requests keep overwriting each other's rows), so the log holds about twice the rows
    the request touched at most.
    """

    serial: int
    #: (rows, their content before, their last writer before), in time order
    entries: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    logged: int = 0  # rows in the log
    compacted: int = 0  # rows in the log after the last compaction
    grown_from: int | None = None  # the matrix's rows before this request first grew it
    grown_to: int = 0  # its rows after this request last grew it

    def log(self, rows: np.ndarray, before: np.ndarray, writers: np.ndarray) -> None:
        self.entries.append((rows, before, writers))
        self.logged += rows.shape[0]
        if self.logged > max(_COMPACT_ROWS, 2 * self.compacted):
            self.compact()

    def compact(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, their content before this request's last run of writes, their writer then): the
        latest entry of each row. Only for a log that holds some."""
        if len(self.entries) > 1:
            rows, before, writers = (np.concatenate(column) for column in zip(*self.entries))
            _, first_reversed = np.unique(rows[::-1], return_index=True)
            latest = rows.shape[0] - 1 - first_reversed
            self.entries = [(rows[latest], before[latest], writers[latest])]
            self.logged = self.compacted = latest.shape[0]
        return self.entries[0]


#: A request's undo log is first compacted when it reaches this many rows.
_COMPACT_ROWS = 4096

#: Request serials (``_Undo.serial``) run 1 .. this, then start again (0 is "no begun request").
_MAX_SERIAL = 2**31 - 1


class TokenRecycling(SourceBase[_Undo]):
    """Draft source: BFS over an adjacency matrix of the model's recycled top-k (Luo et al., 2025).

    Parameters:

    ``k``
        Candidates kept per token (the matrix's width; the paper's ``output_id_topk``, default 8,
        Sec. 4). The decoder takes the model's top-``k`` at every row for this source
        (``top_k = k``). Must exceed the template's largest rank.
    ``template``
        The static draft tree (Sec. 3.2): a name from :data:`TEMPLATES` (``"tr80"``, the paper's
        80-node tree, by default; ``"tr8"``, ``"tr16"``, ``"tr32"`` are its best-first prefixes
        for narrow CPU steps), a :class:`TreeTemplate`, or a list of ``(parent_index, rank)``
        pairs in best-first order (parents first; ``parent_index = -1`` for the root's children).
    ``vocab_size``
        Allocate the matrix for this vocabulary now (``vocab_size * k * 4`` bytes) and refuse
        token ids outside it. ``None`` (default): the matrix grows to the largest token seen.
    ``name``
        The source's name in statistics.

    The matrix lives as long as the source (hot start, Sec. 3.1) and may be shared by decoders
    whose models share a vocabulary; :meth:`reset` empties it. A request that fails is taken back
    by :meth:`abort`.
    """

    def __init__(self, k: int = 8, template: TemplateArg = DEFAULT_TEMPLATE, vocab_size: int | None = None,
                 name: str = "recycle") -> None:
        super().__init__()
        check_int("k", k, 1, " (candidates kept per token)", numpy_ok=True)
        check_int("vocab_size", vocab_size, 1, " (None: grow as tokens are seen)", none_ok=True,
                  numpy_ok=True)
        self.k = int(k)
        self.top_k = self.k
        #: observe only writes the matrix; a draft reads its context and the matrix as it stands
        self.observes_late = True
        self.name = name
        if isinstance(template, TreeTemplate):
            tree = template
        elif isinstance(template, str):
            if template not in TEMPLATES:
                raise ValueError(f"unknown tree template {template!r}; allowed: {', '.join(TEMPLATES)} "
                                 "or a list of (parent_index, rank) pairs")
            tree = TEMPLATES[template]
        elif isinstance(template, Sequence):
            tree = TreeTemplate.from_pairs(template)
        else:
            raise ValueError(f"template must be a name ({', '.join(TEMPLATES)}), a TreeTemplate or a list of "
                             f"(parent_index, rank) pairs, got {template!r}")
        if tree.max_rank >= self.k:
            fits = [n for n, t in TEMPLATES.items() if t.max_rank < self.k]
            raise ValueError(f"template {tree.name!r} uses ranks up to {tree.max_rank}, so it needs k >= "
                             f"{tree.max_rank + 1}, got k={self.k}; named templates that fit k={self.k}: "
                             f"{', '.join(fits) or 'none'}")
        self.template = tree
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        # one extra row at the end, always empty: an empty entry (-1) used as a row index reads it,
        # so an empty node's whole subtree comes out empty with no masking in the BFS
        self._matrix = np.full(((self.vocab_size or 0) + 1, self.k), -1, dtype=np.int32)
        # per row, the serial of the begun request that wrote it last (0: none): what abort needs
        # to tell its own rows from rows another request overwrote since (see _Undo)
        self._writer = np.zeros(self._matrix.shape[0], dtype=np.int32)
        self._serial = 0
        self._lock = threading.Lock()
        self._levels = self._compile(tree)

    @staticmethod
    def _compile(tree: TreeTemplate) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per depth: (node indices, parent slots, ranks). Slot ``len(tree)`` holds the root."""
        n = len(tree)
        depths = np.asarray(tree.depths)
        parents = np.asarray([p if p >= 0 else n for p in tree.parents], dtype=np.intp)
        ranks = np.asarray(tree.ranks, dtype=np.intp)
        levels = []
        for d in range(1, int(depths.max()) + 1):
            idx = np.flatnonzero(depths == d)
            levels.append((idx, parents[idx], ranks[idx]))
        return levels

    # --- the matrix -------------------------------------------------------------------------

    @property
    def matrix(self) -> np.ndarray:
        """A copy of the adjacency matrix ``[rows, k]`` (int32, ``-1`` = empty)."""
        with self._lock:
            return self._matrix[:-1].copy()

    def reset(self) -> None:
        """Forget everything learnt (the paper's cold start); the size is kept."""
        with self._lock:
            self._matrix.fill(-1)
            self._writer.fill(0)  # (a running request's abort then has nothing of its own to put back)

    def _check_token(self, token: int, what: str) -> None:
        if token < 0:
            raise ValueError(f"{self.name}: {what} has token id {token}; token ids must be >= 0")
        if self.vocab_size is not None and token >= self.vocab_size:
            raise ValueError(f"{self.name}: {what} has token id {token}, outside the vocabulary of "
                             f"{self.vocab_size} tokens this source was sized for (vocab_size={self.vocab_size}); "
                             "allowed: 0..{}".format(self.vocab_size - 1))

    def _grow(self, rows: int) -> None:
        """Make the matrix at least ``rows`` rows (under the lock)."""
        have = self._matrix.shape[0] - 1
        if rows <= have:
            return
        new = max(rows, have + have // 2)
        new = -(-new // _GROW_ROWS) * _GROW_ROWS
        # new rows are empty, and the sentinel row stays last and empty
        self._matrix = np.pad(self._matrix[:-1], ((0, new + 1 - have), (0, 0)), constant_values=-1)
        self._writer = np.pad(self._writer[:-1], (0, new + 1 - have))

    # --- the protocol -----------------------------------------------------------------------

    def new_state(self, context: Context) -> _Undo:
        """A begun request logs what it overwrites, so that :meth:`abort` can put it back."""
        with self._lock:
            self._serial = self._serial % _MAX_SERIAL + 1
            return _Undo(self._serial)

    def abort(self, context: Context) -> None:
        """The request failed: put back every row it overwrote and undo the matrix's growth it
        caused, then drop its state (see :class:`~specdraft.sources.base.DraftSource`).

        A row this request wrote last gets back its content (and last writer) from before the
        request's last run of writes to it -- before its first write, unless another request wrote
        the row in between (see ``_Undo``); a row another request has written since keeps that
        newer content. The growth is undone if the matrix is still the size this request last grew
        it to and every row past the old size is empty once the rows are back.

        With no other request writing meanwhile, that is exactly the matrix before the request.
        With concurrent requests that end normally, every row is what they alone would have left
        (the size may differ). When several concurrent requests fail, the matrix is consistent but
        not always exact: a request Q that overwrote a row another request P wrote last logged P's
        content as that row's "before", so if P fails first (its abort leaves the row, which Q wrote
        last) and then Q fails, Q puts P's content back -- draft statistics only, never output.
        Requests not begun, and unknown ids, are ignored.
        """
        undo = self.pop_state(context.request_id)
        if undo is None:
            return
        with self._lock:
            matrix = self._matrix
            if undo.entries:
                rows, before, writers = undo.compact()
                inside = rows < matrix.shape[0] - 1  # (a row past a shrunk matrix is empty anyway)
                rows, before, writers = rows[inside], before[inside], writers[inside]
                ours = self._writer[rows] == undo.serial  # not written by another request since
                rows = rows[ours]
                matrix[rows] = before[ours]
                self._writer[rows] = writers[ours]
            have = matrix.shape[0] - 1
            if undo.grown_from is not None and have == undo.grown_to and \
                    not (matrix[undo.grown_from : have] != -1).any():
                self._matrix = matrix[: undo.grown_from + 1].copy()  # its last row, empty, is the sentinel
                self._writer = self._writer[: undo.grown_from + 1].copy()

    def propose(self, context: Context, budget: int) -> Draft:
        """BFS from the root along the template (Sec. 3.2); one path per existing node, best first,
        at most ``budget`` of them. Nodes with an empty entry are skipped with their subtree."""
        if budget <= 0:
            return Draft()
        root = int(context.root)
        self._check_token(root, "the context's root")
        n = len(self.template)
        tokens = np.empty(n + 1, dtype=np.int64)
        tokens[n] = root
        with self._lock:
            matrix = self._matrix
            if root >= matrix.shape[0] - 1:
                return Draft()  # never seen: an empty row
            for idx, parent_slots, ranks in self._levels:
                # an empty parent (-1) reads the empty last row: its children are empty too
                tokens[idx] = matrix[tokens[parent_slots], ranks]
        values = tokens.tolist()
        paths: list[list[int] | None] = [None] * n
        branches: list[list[int]] = []
        for i, parent in enumerate(self.template.parents):
            token = values[i]
            if token < 0:  # (so is every node below: an empty parent read the empty last row)
                continue
            path = paths[i] = [token] if parent < 0 else paths[parent] + [token]  # type: ignore[operator]
            branches.append(path)
            if len(branches) >= budget:
                break
        return Draft(branches)

    def observe(self, feedback: Feedback) -> None:
        """Each row's input token gets that row's top-k (Sec. 3.3); the last row of a token wins,
        as if the rows were applied in order. Nothing happens without ``top_ids``."""
        top_ids, row_tokens = feedback.top_ids, feedback.row_tokens
        if top_ids is None or row_tokens is None:
            return
        top_ids = np.asarray(top_ids)
        row_tokens = np.asarray(row_tokens)
        if top_ids.ndim != 2 or row_tokens.ndim != 1 or top_ids.shape[0] != row_tokens.shape[0]:
            raise ValueError(f"{self.name}: top_ids must be [rows, k] and row_tokens [rows], got shapes "
                             f"{top_ids.shape} and {row_tokens.shape}")
        if row_tokens.size == 0:
            return
        width = min(self.k, top_ids.shape[1])  # fewer columns only when the vocabulary is below k
        top = top_ids[:, :width]
        low = int(min(row_tokens.min(), top.min())) if width else int(row_tokens.min())
        high = int(max(row_tokens.max(), top.max())) if width else int(row_tokens.max())
        self._check_token(low, "a feedback row")
        self._check_token(high, "a feedback row")
        # last occurrence of each input token = first occurrence in the reversed rows
        unique, first_reversed = np.unique(row_tokens[::-1], return_index=True)
        last = row_tokens.shape[0] - 1 - first_reversed
        values = top[last].astype(np.int32)
        if width < self.k:
            values = np.concatenate([values, np.full((values.shape[0], self.k - width), -1, np.int32)], axis=1)
        undo = self.peek_state(feedback.context.request_id)
        with self._lock:
            have = self._matrix.shape[0] - 1
            self._grow(high + 1)
            if undo is None:  # not a begun request: nothing to take back, but its rows are not ours
                self._writer[unique] = 0
            else:
                if self._matrix.shape[0] - 1 != have:
                    if undo.grown_from is None:
                        undo.grown_from = have
                    undo.grown_to = self._matrix.shape[0] - 1
                writers = self._writer[unique]
                fresh = writers != undo.serial  # rows it did not write last: log them first
                count = np.count_nonzero(fresh)  # (cheaper than .all() / .any() on small arrays)
                if count == fresh.shape[0]:
                    undo.log(unique, self._matrix[unique], writers)
                elif count:
                    rows = unique[fresh]
                    undo.log(rows, self._matrix[rows], writers[fresh])
                self._writer[unique] = undo.serial
            self._matrix[unique] = values

    # --- copies -----------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        with self._lock:  # a consistent matrix, even while other threads update it
            state = super().__getstate__()
            state["_matrix"] = self._matrix.copy()
            state["_writer"] = self._writer.copy()
        return state

    def __repr__(self) -> str:
        return (f"TokenRecycling(k={self.k}, template={self.template.name!r} ({len(self.template)} nodes), "
                f"rows={self._matrix.shape[0] - 1})")
