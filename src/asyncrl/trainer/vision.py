"""Where a vision-language model's image features go in the trainer's forward.

Each row's prompt image tokens take its images' features, in order: the first (features)
image tokens of the row. An image token the model sampled later in the row is embedded as
a token, as the inference servers embed it.

Tiles (Idefics3 / SmolVLM): the features replace the image tokens' embeddings; positions
are the text's. Patches (Qwen2-VL / Qwen2.5-VL): each image is t x h x w merged patches
(its grid divided by the merge size in height and width), and the decoder's rotary
positions are three-dimensional (M-RoPE): a text token has (p, p, p), one past its
predecessor's largest; an image's tokens, starting at p, have (p + t_i, p + h_i, p + w_i)
for their place in its grid, and the text after it starts at p + max(t, h, w). vLLM's
`get_mrope_input_positions` and HF's `get_rope_index` compute the same positions.
"""

from __future__ import annotations

import hashlib

import torch

from asyncrl.api.types import ImageInputs, hash_arrays


def prompt_image_mask(input_ids: torch.Tensor, image_token_id: int,
                      per_row: torch.Tensor) -> torch.Tensor:
    """bool [B, T]: each row's first `per_row[b]` image tokens; ValueError naming a row
    that has fewer."""
    is_image = input_ids == image_token_id
    mask = is_image & (is_image.cumsum(-1) <= per_row[:, None])
    placed = mask.sum(-1)
    if not torch.equal(placed, per_row):
        bad = int((placed != per_row).nonzero()[0, 0])
        raise ValueError(f"row {bad} of the batch has {int(placed[bad])} image tokens for "
                         f"{int(per_row[bad])} image features: its prompt and images must "
                         "come from one processor call")
    return mask


def merged_grids(images: ImageInputs, merge: int) -> torch.Tensor:
    """long [images, 3]: each image's grid of image tokens (t, h / merge, w / merge)."""
    grid = images.image_grid_thw
    if bool((grid[:, 1:] % merge).any()):
        raise ValueError(f"image_grid_thw {grid.tolist()} has heights or widths that are not "
                         f"multiples of the merge size {merge}: the images come from another "
                         "model's processor")
    return torch.cat([grid[:, :1], grid[:, 1:] // merge], dim=1)


def mrope_positions(attention_mask: torch.Tensor, image_mask: torch.Tensor,
                    image_rows: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
    """long [3, B, T]: the M-RoPE positions of right-padded rows (the module doc) whose
    image tokens are `image_mask`; image i belongs to row `image_rows[i]` and has the
    token grid `grids[i]`. Padding positions are 0."""
    batch, width = attention_mask.shape
    out = torch.zeros(3, batch, width, dtype=torch.long)
    grids, rows = grids.tolist(), image_rows.tolist()
    lengths = attention_mask.sum(-1).tolist()
    starts: list[list[int]] = [[] for _ in range(batch)]
    for b, t in image_mask.nonzero().tolist():  # one copy to the host for all rows
        starts[b].append(t)
    for b in range(batch):
        pieces, pos, at, k = [], 0, 0, 0
        for i in (i for i, r in enumerate(rows) if r == b):
            t, h, w = grids[i]
            start = starts[b][k]
            k += t * h * w
            text = start - at
            pieces.append(torch.arange(text).expand(3, text) + pos)
            pos += text
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w),
                                        indexing="ij")
            pieces.append(torch.stack([tt.flatten(), hh.flatten(), ww.flatten()]) + pos)
            pos += max(t, h, w)
            at = start + t * h * w
        text = int(lengths[b]) - at
        pieces.append(torch.arange(text).expand(3, text) + pos)
        out[:, b, :int(lengths[b])] = torch.cat(pieces, dim=1)
    return out.to(attention_mask.device)


def image_keys(input_ids: torch.Tensor, image_token_id: int, images: ImageInputs,
               image_rows: torch.Tensor) -> torch.Tensor:
    """long [B, T]: `input_ids` with each row's image tokens replaced by one negative key per
    distinct set of images (`pack_prefixes`' keys): rows share a trie node through image
    tokens only when their images are equal, pixel for pixel. Equal text with other pixels
    is another prefix."""
    keys = input_ids.clone()
    # One copy to the host for the whole batch; each item's slices of it from there on.
    pixels = images.pixel_values.detach().cpu().contiguous().numpy()
    mask, grid = (None if t is None else t.detach().cpu().contiguous().numpy()
                  for t in (images.pixel_attention_mask, images.image_grid_thw))
    signatures: dict[int, hashlib.blake2b] = {}
    start = 0
    for item, (row, size) in enumerate(zip(image_rows.tolist(), images.item_sizes())):
        digest = signatures.setdefault(row, hashlib.blake2b(digest_size=16))
        hash_arrays(digest, pixels[start:start + size],
                    None if mask is None else mask[start:start + size],
                    None if grid is None else grid[item])
        start += size
    ids: dict[bytes, int] = {}
    for row, digest in signatures.items():
        key = -1 - ids.setdefault(digest.digest(), len(ids))
        keys[row][input_ids[row] == image_token_id] = key
    return keys
