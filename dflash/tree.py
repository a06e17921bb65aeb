"""Draft trees: several candidate continuations verified in one target pass.

At small batch a target pass is bound by reading its weights, not by the tokens it scores:
verifying 32 tokens costs little more than verifying 4 (SmolLM2-135M, bf16, 2 CPU threads,
200 cached tokens: 41.6 ms for 1 token, 44.4 for 4, 48.5 for 16, 53.7 for 32). So a cycle
can verify several guesses at once: the drafter's block, the drafter's runner-up first
tokens continued by the corpus or the context, the context and corpus copies. Branches
that share a prefix share nodes (a trie), so the tree holds each distinct guess once.

Layout, for one row: node 0 is the anchor; every other node holds a drafted token, its
parent's index is smaller than its own, and its position is the anchor's plus its depth.
A node attends to the cache and to its ancestors (itself included), so each node is
scored exactly as if its branch alone had been verified. Worked example, branches
[a b c], [a d], [e]:
    nodes    0:anchor  1:a  2:b  3:c  4:d  5:e
    parents  -1        0    1    2    1    0
    depth    0         1    2    3    2    1

Acceptance walks the tree: at the current node take the target's own token there (its
argmax at T = 0, a sample drawn with that node's uniform at T > 0); if a child holds that
token, move to it and repeat; else that token is the bonus. Every emitted token is the
target's own choice given the emitted prefix, which is the "match" rule of dflash.sampling
applied to a tree, and as lossless. Rows are padded to the batch's widest tree with nodes
that attend only to themselves and are never reached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """A batch of token tries. tokens, parents, depth (b, W); attend (b, W, W) bool, True
    where the query node (dim 1) may see the key node (dim 2): its ancestors and itself.
    children[i] maps (node, token) -> child node of row i; source[i][node] names the branch
    that first created that node ("drafter", "lookup", "corpus"; None for the anchor)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    attend: torch.Tensor
    children: list[dict[tuple[int, int], int]]
    source: list[list[str | None]]

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    @property
    def num_nodes(self) -> list[int]:
        """Each row's own nodes, anchor included (its tree before padding to `width`)."""
        return [len(s) for s in self.source]

    def walk(self, target_tokens: list[list[int]]) -> tuple[list[list[int]], list[int]]:
        """target_tokens[i][n]: the target's token at node n of row i -> (paths, bonus).

        paths[i] lists the nodes kept, anchor first (its length is the accepted drafts + 1);
        bonus[i] is the target's token at the last of them."""
        paths, bonus = [], []
        for kids, y in zip(self.children, target_tokens):
            path = [0]
            while (child := kids.get((path[-1], y[path[-1]]))) is not None:
                path.append(child)
            paths.append(path)
            bonus.append(y[path[-1]])
        return paths, bonus


def build_tree(anchors: list[int], branches: list[list[tuple[list[int], str]]], max_nodes: int,
               device: torch.device | str = "cpu") -> DraftTree:
    """Merge each row's branches (token lists after the anchor, each with its source) into a
    trie of at most max_nodes nodes, anchor included. Branches come in priority order: once
    the budget is spent, later branches (and the rest of a long one) are dropped."""
    if max_nodes < 1:
        raise ValueError(f"a draft tree needs at least one node, got max_nodes={max_nodes}")
    rows = []
    for anchor, row_branches in zip(anchors, branches):
        tokens, parents, depth, source = [anchor], [-1], [0], [None]
        kids: dict[tuple[int, int], int] = {}
        for branch, src in row_branches:
            node = 0
            for tok in branch:
                child = kids.get((node, tok))
                if child is None:
                    if len(tokens) >= max_nodes:
                        break
                    child = len(tokens)
                    kids[(node, tok)] = child
                    tokens.append(tok)
                    parents.append(node)
                    depth.append(depth[node] + 1)
                    source.append(src)
                node = child
        rows.append((tokens, parents, depth, kids, source))

    b, w = len(rows), max(len(r[0]) for r in rows)
    tok_t = torch.zeros(b, w, dtype=torch.long)
    par_t = torch.full((b, w), -1, dtype=torch.long)
    dep_t = torch.zeros(b, w, dtype=torch.long)
    attend = torch.eye(w, dtype=torch.bool).repeat(b, 1, 1)  # padding sees only itself
    for i, (tokens, parents, depth, _, _) in enumerate(rows):
        n = len(tokens)
        tok_t[i, :n] = torch.tensor(tokens)
        par_t[i, :n] = torch.tensor(parents)
        dep_t[i, :n] = torch.tensor(depth)
        for node in range(1, n):  # parents come first, so each row of `attend` copies its parent's
            attend[i, node, :node] = attend[i, parents[node], :node]
    return DraftTree(tok_t.to(device), par_t.to(device), dep_t.to(device), attend.to(device),
                     [r[3] for r in rows], [r[4] for r in rows])


@dataclass(frozen=True)
class TreeConfig:
    """max_nodes: tokens per verify, anchor included; first_candidates: how many of the
    drafter's most likely first tokens start a branch (the best continues with the drafter's
    block, the others with a context or corpus copy where one exists)."""

    max_nodes: int = 32
    first_candidates: int = 4

    def __post_init__(self):
        if self.max_nodes < 2:
            raise ValueError(f"a draft tree needs max_nodes >= 2, got {self.max_nodes}")
        if self.first_candidates < 1:
            raise ValueError(f"first_candidates must be >= 1, got {self.first_candidates}")
