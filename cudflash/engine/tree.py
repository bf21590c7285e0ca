"""Draft trees (DDTree, Ringel and Romano 2026): many continuations verified in one target forward.

A block-diffusion drafter gives, for each position L + d of the block (d = 1 .. S), a distribution over tokens; its
single path keeps the argmax of each. A tree keeps the continuations most likely to match the target: a node at depth
d is a token for position L + d under its parent, and its surrogate score is the product of the drafter's
probabilities along its path. Because every prefix of a path scores at least as high as the path, the N best paths
form a tree, and a best-first heap enumerates them in order (`build_tree`).

Verification feeds the root (the pending token, position L) and every node in one forward: node i sits at position
L + depth(i) for RoPE, at cache slot L + i (`storage`), and attends to the committed keys and to its ancestors
(`ancestor_masks`). Nodes are numbered in creation order, so a parent precedes its children: the ancestor mask is
causal in storage order. The walk (`walk`) starts at the root and follows the target's own choice at each node (its
argmax, or its sample: the output is then distributed exactly as the target's) while that token is a child; the
first choice that is not becomes the next pending token. The matched path's K/V then move from their storage slots to
the slots of positions L + 1 .. L + a (`compaction`).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class DraftTree:
    tokens: np.ndarray  # int64 [N]: node i's token
    parents: np.ndarray  # int64 [N]: node i's parent, -1 for the root (the pending token)
    depths: np.ndarray  # int64 [N]: 1 for the root's children

    @property
    def size(self) -> int:
        return len(self.tokens)


def build_tree(logprobs: np.ndarray, ids: np.ndarray, budget: int) -> DraftTree:
    """The `budget` nodes of highest path score for a drafter whose positions are drafted independently (DFlash):
    logprobs [S, K] (each row descending) and ids [S, K], the K most likely tokens for depths 1..S."""
    return best_first(len(logprobs), budget, lambda depth, key: (logprobs[depth], ids[depth], None))


def build_lattice_tree(scores: np.ndarray, cand: np.ndarray, budget: int) -> DraftTree:
    """The same over a lattice whose choices depend on the parent's (DFlash2's selector): scores [S, K, K] (row e:
    predecessor candidate, candidate; depth 1's predecessor is the pending token, every row the same) and cand
    [S, K] the candidates' tokens. A node's children are ranked by the softmax of its own row."""
    ranked: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def children(depth: int, key: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        k = 0 if key is None else key
        if (depth, k) not in ranked:
            row = scores[depth, k].astype(np.float64)
            logp = row - row.max() - np.log(np.exp(row - row.max()).sum())
            order = np.argsort(-logp, kind="stable")
            ranked[depth, k] = (logp[order], cand[depth, order], order)
        return ranked[depth, k]

    return best_first(len(scores), budget, children)


def best_first(slots: int, budget: int, children) -> DraftTree:
    """Best-first enumeration of paths by score (the sum of log-probabilities along them). children(depth, key) ->
    (log-probabilities descending, their tokens, their keys or None) of the candidates under a node whose key is
    `key` (None for the root). Ties go to the node found first (shallower, then lower rank)."""
    tokens, parents, depths = [], [], []
    # heap of (-score, order, depth index, rank, parent node, parent key): a candidate node not yet in the tree
    heap = []
    if slots and budget > 0 and len(children(0, None)[0]):
        heap.append((-float(children(0, None)[0][0]), 0, 0, 0, -1, None))
    order = 1
    while heap and len(tokens) < budget:
        neg, _, d, r, parent, parent_key = heapq.heappop(heap)
        logp, toks, keys = children(d, parent_key)
        node = len(tokens)
        tokens.append(int(toks[r]))
        parents.append(parent)
        depths.append(d + 1)
        if r + 1 < len(logp):  # its next sibling: same parent, the next most likely candidate
            heapq.heappush(heap, (neg + float(logp[r]) - float(logp[r + 1]), order, d, r + 1, parent, parent_key))
            order += 1
        if d + 1 < slots:  # its first child: the most likely candidate at the next depth under this node
            key = None if keys is None else int(keys[r])
            heapq.heappush(heap, (neg - float(children(d + 1, key)[0][0]), order, d + 1, 0, node, key))
            order += 1
    return DraftTree(np.asarray(tokens, np.int64), np.asarray(parents, np.int64), np.asarray(depths, np.int64))


def ancestor_masks(tree: DraftTree) -> np.ndarray:
    """bool [N + 1, N + 1]: row i sees column j (storage order, 0 = the root) iff j is i or one of its ancestors."""
    n = tree.size + 1
    mask = np.zeros((n, n), dtype=bool)
    mask[0, 0] = True
    for i in range(1, n):
        mask[i] = mask[tree.parents[i - 1] + 1]
        mask[i, i] = True
    return mask


def words_for(nodes: int) -> int:
    """int32 words of a row's mask over the root and `nodes` nodes."""
    return -(-(nodes + 1) // 32)


def pack_bits(mask: np.ndarray, words: int) -> np.ndarray:
    """bool [rows, cols] -> int32 [rows, words]: bit j % 32 of word j // 32 is column j."""
    rows, cols = mask.shape
    padded = np.zeros((rows, words * 32), dtype=bool)
    padded[:, :cols] = mask
    weights = (1 << np.arange(32, dtype=np.uint64)).astype(np.uint64)
    packed = (padded.reshape(rows, words, 32).astype(np.uint64) * weights).sum(axis=2)
    return packed.astype(np.uint32).view(np.int32)


def children_of(tree: DraftTree) -> list[dict[int, int]]:
    """Per storage row (0 = root): token -> the child node's storage row."""
    out: list[dict[int, int]] = [{} for _ in range(tree.size + 1)]
    for i in range(tree.size):
        out[tree.parents[i] + 1].setdefault(int(tree.tokens[i]), i + 1)
    return out


def walk(tree: DraftTree, choose) -> tuple[list[int], list[int]]:
    """(storage rows of the matched path, root first; the tokens emitted: the matched nodes' tokens and the first
    choice that is not a child). choose(row) is the target's token at that storage row (argmax or sample)."""
    kids = children_of(tree)
    row, path, emitted = 0, [0], []
    while True:
        token = choose(row)
        emitted.append(token)
        child = kids[row].get(token)
        if child is None:
            return path, emitted
        path.append(child)
        row = child
