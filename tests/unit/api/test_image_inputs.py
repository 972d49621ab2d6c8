"""ImageInputs in its two layouts: what it accepts, its items, its JSON form, and joining."""

import pytest
import torch

from asyncrl.api.types import ImageInputs


def grid_images(*grids, seed=0) -> ImageInputs:
    grid = torch.tensor(grids)
    g = torch.Generator().manual_seed(seed)
    return ImageInputs(pixel_values=torch.randn(int(grid.prod(-1).sum()), 6, generator=g),
                       image_grid_thw=grid)


def test_patches_are_split_by_their_grids():
    images = grid_images((1, 2, 2), (2, 1, 3))
    assert images.n_items == 2 and images.item_sizes() == [4, 6]
    second = images.items(1, 2)
    assert torch.equal(second.pixel_values, images.pixel_values[4:10])
    assert second.image_grid_thw.tolist() == [[2, 1, 3]]


def test_json_round_trip_keeps_both_layouts():
    for images in (grid_images((1, 2, 2)),
                   ImageInputs(pixel_values=torch.rand(2, 3, 4, 4),
                               pixel_attention_mask=torch.rand(2, 4, 4) > 0.5)):
        back = ImageInputs.from_dict(images.to_dict())
        assert torch.equal(back.pixel_values, images.pixel_values)
        for name in ("pixel_attention_mask", "image_grid_thw"):
            a, b = getattr(back, name), getattr(images, name)
            assert (a is None and b is None) or torch.equal(a, b)


def test_a_later_turns_images_start_with_an_earlier_turns():
    both = grid_images((1, 2, 2), (1, 2, 4))
    first = both.items(0, 1)
    assert both.starts_with(first) and not first.starts_with(both)
    other = grid_images((1, 2, 2), seed=1)
    assert not both.starts_with(other)


@pytest.mark.parametrize("kwargs,message", [
    ({"pixel_values": torch.rand(5, 6), "image_grid_thw": torch.tensor([[1, 2, 2]])},
     r"pixel_values holds 5 patches but image_grid_thw \[\[1, 2, 2\]\] makes 4"),
    ({"pixel_values": torch.rand(4, 6), "image_grid_thw": torch.tensor([1, 2, 2])},
     r"image_grid_thw must be int64 \[images >= 1, 3\]"),
    ({"pixel_values": torch.rand(1, 3, 4, 4), "image_grid_thw": torch.tensor([[1, 1, 1]])},
     r"with image_grid_thw, pixel_values must be float32 \[patches, patch values\]"),
])
def test_inconsistent_patches_are_refused_with_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ImageInputs(**kwargs)


def test_two_layouts_do_not_join():
    tiles = ImageInputs(pixel_values=torch.rand(1, 3, 4, 4))
    with pytest.raises(ValueError, match="images of two layouts"):
        ImageInputs.cat([tiles, grid_images((1, 2, 2))])
