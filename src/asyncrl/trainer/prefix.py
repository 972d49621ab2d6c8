"""Shared-prefix packing: a micro-batch's rows as a token trie, each shared prefix run once.

The samples of a GRPO group share their prompt, an agent's turns every earlier turn. Laid out
as the nodes of their trie (one node per distinct prefix), each node attending exactly to its
ancestors and itself at position = its depth, a node's hidden state is that of its token in
every unpacked row through it. Rows read their shared nodes' hidden states, so in backward
those nodes receive the sum of the rows' gradients: the gradient is exact, not approximated.

Layout. Rows are sorted by their token sequence; in that order a row's longest common prefix
with any earlier row is the one with its predecessor, so appending each row's tokens after
that prefix lists the trie depth-first (preorder). A row starts a new tree (duplicating the
prefix) when it shares fewer than MIN_SHARED_TOKENS with its predecessor, or when the tree
would grow past `capacity` nodes. Trees are packed into rows of `capacity` nodes, first fit
decreasing; the ancestor mask keeps the trees of one packed row apart.

The decoder runs on the real nodes only, as one row [1, N] (`model_inputs`): its linear
layers compute no padding. Only attention sees the packed rows: `trainer/cpu/attention.py`
scatters queries, keys and values into them, applies the ancestor mask and gathers back.

Shapes. `node_multiple` and `width_multiple` round the node count and the rows' width up,
with padding nodes that see only themselves (token 0 at position 0, in free slots of the
packed rows, which gain a row if they have too few): every batch of a run has other sizes,
and oneDNN builds a matmul primitive for each shape it has not seen (~3 ms each on the CPU,
~19 per step), while a few rounded sizes recur. The padding nodes carry no loss, so their
gradient is zero and every real node's value the same.

Why twice the longest row as the default capacity: the attention over a packed row is dense
(the mask removes no work), so it costs capacity^2, within 4x of one padded row, while a
group of short answers still shares its prompt; and trees are small enough to pack densely.
"""

from __future__ import annotations

import dataclasses

import torch

# Fewer shared tokens than this are not worth tying two rows to one tree (a BOS or a chat
# header shared by every row would put the whole micro-batch into one).
MIN_SHARED_TOKENS = 8


@dataclasses.dataclass
class PrefixPack:
    """A micro-batch [B, T] packed as trie nodes [R, L], and the maps between the two."""

    input_ids: torch.Tensor  # [R, L] long: each node's token, 0 on padding
    attention_mask: torch.Tensor  # [R, 1, L, L] bool: key j is an ancestor-or-self of query i
    position_ids: torch.Tensor  # [R, L] long: each node's depth = its position in its rows
    node_of: torch.Tensor  # [B, T] long: the flat node (r * L + l) of each token, -1 on padding
    parent: torch.Tensor  # [R * L] long: each node's parent (flat), -1 for roots and padding
    slots: torch.Tensor  # [N + P] long: the flat slot of each node the decoder runs, ascending
    n_nodes: int  # real nodes N, padding excluded
    n_padding: int = 0  # padding nodes P the decoder runs as well (`node_multiple`)

    def to(self, device: torch.device) -> PrefixPack:
        """The same pack with every tensor on `device`."""
        return dataclasses.replace(self, **{
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), torch.Tensor)})

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The HF decoder's keyword arguments for the packed forward: the nodes as one row
        [1, N + P]; the mask over the packed rows and `trie_slots` for the attention
        (`trainer/cpu/attention.py`, which the model must use)."""
        return {"input_ids": self.input_ids.flatten()[self.slots][None],
                "position_ids": self.position_ids.flatten()[self.slots][None],
                "attention_mask": self.attention_mask, "trie_slots": self.slots}

    def to_slots(self, per_node: torch.Tensor) -> torch.Tensor:
        """The decoder's output [1, N + P, ...] laid out per slot [R, L, ...], 0 on free
        slots."""
        flat = per_node.new_zeros((self.input_ids.numel(), *per_node.shape[2:]))
        return flat.index_copy(0, self.slots, per_node[0]).unflatten(0, self.input_ids.shape)

    def chosen_nodes(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The distinct nodes of tokens 1.. where `chosen` ([B, T - 1] bool), and the index of
        each chosen token (row-major, as `masked_scatter` reads) into them."""
        return torch.unique(self.node_of[:, 1:][chosen], return_inverse=True)

    def from_rows(self, per_token: torch.Tensor) -> torch.Tensor:
        """Per-token values [B, T, ...] as the decoder's input [1, N + P, ...]: each node's
        from one of the tokens it stands for (equal for all of them: they share the prefix
        and its keys), padding nodes' from the first token. A gather, so in backward each
        value's gradient reaches the token it was read from."""
        real = self.node_of >= 0
        source = torch.zeros(self.input_ids.numel(), dtype=torch.long,
                             device=self.node_of.device)
        source[self.node_of[real]] = torch.arange(
            self.node_of.numel(), device=self.node_of.device)[real.flatten()]
        return per_token.flatten(0, 1)[source[self.slots]][None]

    def unpack(self, per_node: torch.Tensor) -> torch.Tensor:
        """Per-node values [R, L] as per-token values [B, T]: each token's node's, 0 on padding."""
        real = self.node_of >= 0
        values = per_node.flatten()[self.node_of.clamp(min=0)]
        return torch.where(real, values, torch.zeros((), dtype=values.dtype, device=values.device))


def pack_prefixes(input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                  keys: torch.Tensor | None = None, capacity: int | None = None,
                  min_shared: int = MIN_SHARED_TOKENS, node_multiple: int = 1,
                  width_multiple: int = 1) -> PrefixPack:
    """The trie packing of right-padded rows (CPU tensors); capacity: twice the longest row.
    The nodes the decoder runs and the rows' width are rounded up to the multiples given.
    `keys` ([B, T], default `input_ids`): what two rows' tokens must equal to share a node,
    where a token stands for more than its id (an image token, for its image's pixels)."""
    if node_multiple < 1 or width_multiple < 1:
        raise ValueError(f"node_multiple and width_multiple must be >= 1, got {node_multiple} "
                         f"and {width_multiple}")
    if keys is not None and keys.shape != input_ids.shape:
        raise ValueError(f"keys {tuple(keys.shape)} must have the shape of input_ids "
                         f"{tuple(input_ids.shape)}")
    lengths = attention_mask.sum(-1).tolist()
    capacity = capacity or 2 * max(max(lengths), 1)
    if max(lengths) > capacity:
        raise ValueError(f"a row of {max(lengths)} tokens exceeds the capacity {capacity}")
    trees, sizes = _grow_trees(input_ids if keys is None else keys, lengths, capacity,
                               min_shared)
    rows = _pack_trees(sizes, capacity)
    width = _round_up(max(sum(sizes[t] for t in row) for row in rows), width_multiple)
    n_nodes = sum(sizes)
    padding = _round_up(n_nodes, node_multiple) - n_nodes
    n_rows = len(rows) + max(0, -(-(padding - (len(rows) * width - n_nodes)) // width))
    node_of = torch.full(input_ids.shape, -1, dtype=torch.long)
    mask = torch.eye(width, dtype=torch.bool).repeat(n_rows, 1, 1)  # padding sees itself
    causal = torch.ones(input_ids.shape[1], input_ids.shape[1], dtype=torch.bool).tril()
    for r, row in enumerate(rows):
        offset = 0
        for t in row:
            previous = None
            for b, shared in trees[t]:
                n, new = lengths[b], lengths[b] - shared
                if shared:
                    node_of[b, :shared] = node_of[previous, :shared]
                node_of[b, shared:n] = r * width + offset + torch.arange(new)
                local = node_of[b, :n] - r * width
                mask[r, local[shared:, None], local[None, :]] = causal[shared:n, :n]
                offset, previous = offset + new, b
    return _finish(input_ids, attention_mask, node_of, mask, n_nodes, padding)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _grow_trees(input_ids: torch.Tensor, lengths: list[int], capacity: int,
                min_shared: int) -> tuple[list[list[tuple[int, int]]], list[int]]:
    """Trees as [(row, tokens shared with the tree's previous row)] in sorted order, and sizes."""
    seqs = [input_ids[b, :n].tolist() for b, n in enumerate(lengths)]
    trees: list[list[tuple[int, int]]] = []
    sizes: list[int] = []
    previous = None
    for b in sorted(range(len(seqs)), key=seqs.__getitem__):
        shared = 0 if previous is None else _common_prefix(input_ids, previous, b,
                                                           min(lengths[previous], lengths[b]))
        if trees and shared >= min_shared and sizes[-1] + lengths[b] - shared <= capacity:
            trees[-1].append((b, shared))
            sizes[-1] += lengths[b] - shared
        else:
            trees.append([(b, 0)])
            sizes.append(lengths[b])
        previous = b
    return trees, sizes


def _common_prefix(input_ids: torch.Tensor, a: int, b: int, n: int) -> int:
    differ = (input_ids[a, :n] != input_ids[b, :n]).nonzero()
    return int(differ[0]) if len(differ) else n


def _pack_trees(sizes: list[int], capacity: int) -> list[list[int]]:
    """Trees per packed row: first fit decreasing into rows of `capacity` nodes."""
    rows: list[list[int]] = []
    loads: list[int] = []
    for t in sorted(range(len(sizes)), key=lambda t: (-sizes[t], t)):
        r = next((r for r, load in enumerate(loads) if load + sizes[t] <= capacity), len(rows))
        if r == len(rows):
            rows.append([])
            loads.append(0)
        rows[r].append(t)
        loads[r] += sizes[t]
    return rows


def _finish(input_ids: torch.Tensor, attention_mask: torch.Tensor, node_of: torch.Tensor,
            mask: torch.Tensor, n_nodes: int, padding: int) -> PrefixPack:
    """Tokens, depths and parents of the nodes, from each row's token -> node map; the
    first `padding` free slots become padding nodes (token 0, depth 0, no parent)."""
    n_rows, width = mask.shape[0], mask.shape[-1]
    real = attention_mask.bool()
    nodes = node_of[real]
    tokens = torch.zeros(n_rows * width, dtype=torch.long)
    tokens[nodes] = input_ids[real]
    depth = torch.zeros(n_rows * width, dtype=torch.long)
    depth[nodes] = torch.arange(input_ids.shape[1]).expand_as(node_of)[real]
    parent = torch.full((n_rows * width,), -1, dtype=torch.long)
    inner = real[:, 1:]  # a row's token t >= 1 is a child of its token t - 1
    parent[node_of[:, 1:][inner]] = node_of[:, :-1][inner]
    slots = torch.unique(nodes)
    if padding:
        free = torch.ones(n_rows * width, dtype=torch.bool)
        free[slots] = False
        slots = torch.cat([slots, free.nonzero().flatten()[:padding]]).sort().values
    return PrefixPack(input_ids=tokens.view(n_rows, width), attention_mask=mask[:, None],
                      position_ids=depth.view(n_rows, width), node_of=node_of, parent=parent,
                      slots=slots, n_nodes=n_nodes, n_padding=padding)
