"""Tree drafts: several candidate continuations verified in one forward.

A chain of k drafts is lost at its first wrong guess. A tree keeps the
runners-up too: the root is the request's last token, its children are the
heads' best few guesses for the next token, each of those has children of
its own, and so on (Medusa, Cai et al. 2024; EAGLE, Li et al. 2024). The
target verifies every node at once and keeps the deepest path whose every
token it agrees with, so a wrong first guess can still be rescued by the
second one (a request that samples walks the tree with rejection sampling
instead: ``tree_verdict_sampled``).

The shape is static: a list of paths, each the ranks of the guesses taken at
each depth (``(0, 1)`` is the best guess's second-best child). Nodes are
numbered breadth-first, so the nodes of depth at most k are the first
``nodes_within(k)``: a step of draft length k verifies that prefix of the
tree, and the scheduler counts 1 + nodes_within(k) rows per round.

How a round of tree drafts runs through the ordinary decode attention: row 0
of a request is its last token at sequence index L - 1 (L tokens held), node
j (1-based) is written to sequence index L - 1 + j but at *position*
L - 1 + depth(j) (its rotary position: the depth along its path), and it sees
the request's first L keys plus its own ancestors, which a packed mask per
row says (``AttentionMetadata.tree_masks``: bit d covers the key d indices
back). After the verdict, the accepted path's keys and values are moved from
their node slots to the next sequence indices (``compact_kv``), so the cache
is exactly what a chain of the accepted tokens would have written.

Everything here is tensor operations without host reads, so a round can be
queued (or captured) without waiting for the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from executor_svc.sampler import RequestSamplingState, config_probs
from kvcache.layout import device_slots
from plugins.attention_metadata import TREE_MASK_BITS
from plugins.kv_cache_quant import as_bytes

# Medusa-style sparse tree of 14 nodes: the best guess's path is always followed to depth 4, the
# runners-up only where they were seen to pay (a second or third guess at depth 1, a second below).
DEFAULT_TREE: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,),
    (0, 0), (0, 1), (1, 0), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0),
)
MAX_RANK = 16  # the most guesses one node may branch into
MAX_NODES = TREE_MASK_BITS - 1  # a node's mask covers itself, the root and every earlier node


def parse_tree(spec: str) -> tuple[tuple[int, ...], ...] | None:
    """``--draft-tree``: "chain" (None: drafts form a chain), "default", or paths such as "0;1;0,0;0,1"."""
    spec = spec.strip()
    if spec in ("", "chain"):
        return None
    if spec == "default":
        return DEFAULT_TREE
    try:
        return tuple(tuple(int(r) for r in path.split(",")) for path in spec.split(";") if path.strip())
    except ValueError:
        raise ValueError(f"draft tree {spec!r}: expected 'chain', 'default' or paths like '0;1;0,0'") from None


@dataclass(frozen=True)
class DraftTree:
    """A static draft tree; node 0 is the root (the request's last token), nodes 1..N in breadth-first order."""

    paths: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...] = field(init=False)  # [N + 1]; the root is its own parent
    depths: tuple[int, ...] = field(init=False)  # [N + 1]
    ranks: tuple[int, ...] = field(init=False)  # [N + 1]: which guess of its parent a node is (root: 0)

    def __post_init__(self) -> None:
        paths = tuple(tuple(p) for p in self.paths)
        if not paths:
            raise ValueError("a draft tree needs at least one node")
        if len(paths) > MAX_NODES:
            raise ValueError(f"a draft tree holds at most {MAX_NODES} nodes, got {len(paths)}")
        if len(set(paths)) != len(paths):
            raise ValueError("draft tree paths must be distinct")
        for p in paths:
            if not p or any(not 0 <= r < MAX_RANK for r in p):
                raise ValueError(f"draft tree path {p}: ranks must be in [0, {MAX_RANK})")
            if len(p) > 1 and p[:-1] not in paths:
                raise ValueError(f"draft tree path {p} has no parent {p[:-1]} in the tree")
        deepest = max(len(p) for p in paths)
        if any((0,) * d not in paths for d in range(1, deepest + 1)):
            # The plan's drafts (the heads' chain) enter a step's first round on that path.
            raise ValueError(f"a draft tree must hold the best-guess path (0,), (0, 0), ... to its depth {deepest}")
        ordered = tuple(sorted(paths, key=lambda p: (len(p), p)))  # breadth-first
        index = {p: i + 1 for i, p in enumerate(ordered)}
        object.__setattr__(self, "paths", ordered)
        object.__setattr__(self, "parents", (0,) + tuple(index.get(p[:-1], 0) for p in ordered))
        object.__setattr__(self, "depths", (0,) + tuple(len(p) for p in ordered))
        object.__setattr__(self, "ranks", (0,) + tuple(p[-1] for p in ordered))

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return self.depths[-1]

    def nodes_within(self, k: int) -> int:
        """Nodes of depth at most ``k``: the rows (besides the root) a round of draft length k verifies."""
        return sum(1 for d in self.depths[1:] if d <= k)

    def ancestors(self, node: int) -> list[int]:
        """The nodes on the path from the root to ``node``: [depth 1 node, ..., node] (empty for the root)."""
        path = []
        while node:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def row_masks(self, n: int) -> list[int]:
        """Packed attention masks of the root and the first ``n`` nodes (int64 bit patterns, see module doc)."""
        masks = [-1]
        for j in range(1, n + 1):
            hidden = 0  # bits of the earlier nodes that are not on j's path
            on_path = set(self.ancestors(j))
            for i in range(1, j):
                if i not in on_path:
                    hidden |= 1 << (j - i)
            masks.append(_as_int64(~hidden & ((1 << 64) - 1)))
        return masks


def _as_int64(bits: int) -> int:
    return bits - (1 << 64) if bits >= 1 << 63 else bits


class TreeTensors:
    """A tree's index tensors for a draft length k on one device (built once, reused by every round)."""

    def __init__(self, tree: DraftTree, k: int, device: torch.device) -> None:
        n = tree.nodes_within(k)
        self.k, self.num_nodes = k, n
        as_t = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
        self.parents = as_t(tree.parents[: n + 1])  # [1 + n]
        self.depths = as_t(tree.depths[: n + 1])  # [1 + n]
        self.masks = as_t(tree.row_masks(n))  # [1 + n]
        # The path to each node, padded with the node itself past its depth: [1 + n, k].
        paths = [(tree.ancestors(j) + [j] * k)[:k] for j in range(n + 1)]
        self.paths = as_t(paths)
        by_depth = [[j for j in range(n + 1) if tree.depths[j] == d] for d in range(k + 1)]
        self.levels = [as_t(level) for level in by_depth[1:]]  # nodes of depth 1..k
        self.steps = torch.arange(1, k + 1, device=device)  # [k]
        # Each node's children within depth k, best guess first, padded with -1: [1 + n, widest].
        kids = [sorted((c for c in range(1, n + 1) if tree.parents[c] == j), key=lambda c: tree.ranks[c])
                for j in range(n + 1)]
        widest = max(1, max(len(c) for c in kids))
        self.children = as_t([c + [-1] * (widest - len(c)) for c in kids])
        # How heads grow the tree level by level (``draft_heads.py``): for depth d = 0..k-1, the level's
        # nodes that have children ("expanding"), and for each node of depth d + 1 the position of its
        # parent among them, its rank, and the guesses to take per parent (the largest rank + 1).
        self.grow: list[TreeLevel] = []
        for d in range(k):
            expanding = [j for j in by_depth[d] if any(tree.parents[c] == j for c in by_depth[d + 1])]
            children = by_depth[d + 1]
            self.grow.append(TreeLevel(
                expanding=as_t([by_depth[d].index(j) for j in expanding]),
                parent_pos=as_t([expanding.index(tree.parents[c]) for c in children]),
                ranks=as_t([tree.ranks[c] for c in children]),
                width=1 + max(tree.ranks[c] for c in children),
            ))


@dataclass(frozen=True, slots=True)
class TreeLevel:
    """One level of growing a tree (``TreeTensors.grow``)."""

    expanding: torch.Tensor  # positions, within the level, of the nodes with children
    parent_pos: torch.Tensor  # per child: its parent's position within ``expanding``
    ranks: torch.Tensor  # per child: which guess of its parent it is
    width: int  # guesses taken per expanding node


def tree_round_inputs(
    last: torch.Tensor,  # [B] each request's last token (the root)
    lens: torch.Tensor,  # [B] tokens held (the last is not in the cache yet)
    nodes: torch.Tensor,  # [B, n] the tree's draft tokens
    tables: torch.Tensor,  # [B, blocks] block tables
    t: TreeTensors,
    tokens_per_block: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tree round's rows, [B, 1 + n] each: ids, rotary positions, KV slots, context lengths, masks."""
    base = (lens - 1)[:, None]
    ids = torch.cat([last[:, None], nodes], dim=1)
    positions = base + t.depths
    seq = base + torch.arange(t.num_nodes + 1, device=lens.device)
    return ids, positions, device_slots(tables, seq, tokens_per_block), seq + 1, t.masks.expand(ids.shape[0], -1)


def tree_verdict(
    ids: torch.Tensor,  # [B, 1 + n] the round's row tokens (root, then nodes)
    target: torch.Tensor,  # [B, 1 + n] the target's greedy token after each row
    t: TreeTensors,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # tokens [B, 1 + k], accepted [B], best node [B]
    """Greedy verification of a tree: a node is accepted when its parent is and it is the token the target
    chose after its parent. The deepest accepted node ends the path; ``tokens`` holds the path's drafts and
    then the target's token after its last node (what the round emits: ``accepted + 1`` tokens)."""
    batch = ids.shape[0]
    ok = torch.ones_like(ids, dtype=torch.bool)
    match = ids == target.index_select(1, t.parents)  # [B, 1 + n]; column 0 is meaningless
    for level in t.levels:  # parents come a level before their children
        ok.index_copy_(1, level, match.index_select(1, level) & ok.index_select(1, t.parents.index_select(0, level)))
    score = ok * t.depths  # the deepest accepted node; argmax takes the first of equals
    best = score.argmax(dim=1)  # [B]
    accepted = t.depths.index_select(0, best)  # [B]
    path = t.paths.index_select(0, best)  # [B, k]
    tokens = torch.cat([ids.gather(1, path), torch.zeros((batch, 1), dtype=ids.dtype, device=ids.device)], dim=1)
    tokens.scatter_(1, accepted[:, None], target.gather(1, best[:, None]))
    return tokens, accepted, best


def tree_verdict_sampled(
    ids: torch.Tensor,  # [S, 1 + n] the round's row tokens of S sampled requests
    logits: torch.Tensor,  # [S, 1 + n, vocab] the target's logits after each row
    t: TreeTensors,
    states: Sequence[RequestSamplingState],  # [S] the requests' sampling states (none greedy)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # tokens [S, 1 + k], accepted [S], best node [S]
    """Lossless verification of a tree for sampled requests (``tree_verdict``'s contract).

    The drafts are deterministic (the heads' best guesses), so each node's draft
    distribution is a point mass, and the chain rule of ``verify.py`` extends to
    siblings (SpecInfer, Miao et al. 2024): at a node whose target distribution is
    p, its children are tried in turn, best guess first; child x is accepted with
    probability p(x) / sum(p), and a rejected child's token is removed from p. An
    accepted child becomes the node and the walk goes on below it; when every
    child is rejected (or the node has none) the round ends with a token drawn
    from what is left of p. Each removal keeps the rest of p in proportion, so the
    token emitted at every depth follows the target's distribution exactly, as if
    no tree had been drafted. Each request draws from its own generator.
    """
    batch, rows = ids.shape
    k, widest = t.k, t.children.shape[1]
    device = ids.device
    probs = config_probs(logits.reshape(batch * rows, -1), [s.config for s in states for _ in range(rows)])
    probs = probs.view(batch, rows, -1)
    uniform = torch.empty((batch, k + 1, widest), dtype=torch.float32, device=device)
    noise = torch.empty((batch, probs.shape[2]), dtype=torch.float32, device=device)
    for i, state in enumerate(states):
        state._catch_up(probs.shape[2], device)
        uniform[i].uniform_(generator=state.generator)
        noise[i].exponential_(generator=state.generator)
    noise.clamp_min_(torch.finfo(torch.float32).tiny)  # a zero draw would turn a removed token's 0/0 into NaN
    every = torch.arange(batch, device=device)
    node = torch.zeros(batch, dtype=torch.int64, device=device)
    accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    tokens = torch.zeros((batch, k + 1), dtype=torch.int64, device=device)
    for depth in range(k + 1):  # the node is at this depth; depth k has no children
        p = probs[every, node]  # [S, vocab], a copy (advanced indexing); not renormalised as children are removed
        chosen = torch.full((batch,), -1, dtype=torch.int64, device=device)
        for rank in range(widest):
            child = t.children[node, rank]
            tried = (child >= 0) & ~done & (chosen < 0)
            token = ids.gather(1, child.clamp_min(0)[:, None])  # [S, 1]
            mass = p.gather(1, token).squeeze(1)
            accept = tried & (uniform[:, depth, rank] * p.sum(dim=1) < mass)
            chosen = torch.where(accept, child, chosen)
            p.scatter_(1, token, torch.where(tried & ~accept, 0.0, mass)[:, None])
        ends = ~done & (chosen < 0)
        # Where the round ends: a draw from what is left of p (the exponential race ignores the scale).
        own = (p / noise).argmax(dim=1)
        drafted = ids.gather(1, chosen.clamp_min(0)[:, None]).squeeze(1)
        tokens[:, depth] = torch.where(ends, own, torch.where(done, tokens[:, depth], drafted))
        goes_on = ~done & ~ends
        accepted += goes_on.to(torch.int64)
        node = torch.where(goes_on, chosen, node)
        done |= ends
    return tokens, accepted, node


def top_ids(logits: torch.Tensor, width: int) -> torch.Tensor:
    """Ids of the ``width`` largest logits along the last dimension, best first: [..., V] -> [..., width].
    On a GPU one Triton kernel (``tree_triton.top_guesses``), where ``torch.topk`` over a vocabulary is slow."""
    if width == 1:
        return logits.argmax(dim=-1, keepdim=True)
    if not logits.is_cuda:
        return logits.topk(width, dim=-1).indices
    from executor_svc.speculative.tree_triton import top_guesses

    flat = logits if logits.dim() == 2 else logits.reshape(-1, logits.shape[-1])
    return top_guesses(flat, width).view(*logits.shape[:-1], width)


def move_accepted_kv(
    kv_cache: torch.Tensor, lens: torch.Tensor, best: torch.Tensor, accepted: torch.Tensor, tables: torch.Tensor,
    t: TreeTensors, tokens_per_block: int,
) -> None:
    """``compact_kv``; on a GPU as one Triton kernel (``tree_triton.move_kv``)."""
    if not kv_cache.is_cuda:
        compact_kv(kv_cache, lens, best, accepted, tables, t, tokens_per_block)
        return
    from executor_svc.speculative.tree_triton import move_kv

    move_kv(kv_cache, lens, best, accepted, tables, t.paths, tokens_per_block)


def compact_kv(
    kv_cache: torch.Tensor,  # [layers, 2, blocks, tokens_per_block, kv_heads, D]
    lens: torch.Tensor,  # [B] tokens held before the round
    best: torch.Tensor,  # [B] the round's deepest accepted node
    accepted: torch.Tensor,  # [B]
    tables: torch.Tensor,  # [B, blocks]
    t: TreeTensors,
    tokens_per_block: int,
) -> None:
    """Move the accepted path's keys and values from their node slots (L - 1 + node) to the sequence
    indices a chain would have used (L - 1 + depth). Past the accepted depth each slot is copied onto
    itself; all reads happen before any write, so overlapping moves are safe."""
    base = (lens - 1)[:, None]
    path = t.paths.index_select(0, best)  # [B, k]: node at depth 1..k (the best node repeated past its depth)
    dst_seq = base + t.steps
    src_seq = torch.where(t.steps[None, :] <= accepted[:, None], base + path, dst_seq)
    cache = as_bytes(kv_cache)
    flat = cache.view(*cache.shape[:2], -1, *cache.shape[4:])  # [layers, 2, blocks * tokens_per_block, kv_heads, D]
    src = device_slots(tables, src_seq, tokens_per_block).flatten()
    dst = device_slots(tables, dst_seq, tokens_per_block).flatten()
    flat.index_copy_(2, dst, flat.index_select(2, src))
