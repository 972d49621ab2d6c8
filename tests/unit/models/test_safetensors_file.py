"""The safetensors writer and mapped reader (models/safetensors_file.py), checked against
the safetensors package itself (its reader for our files, its writer for our reader), and
the weight publisher's spare folder that makes each save a write in place."""

import os
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncrl.models import safetensors_file
from asyncrl.models.safetensors_file import SafetensorsFormatError, mapped, write
from asyncrl.weights import WeightPublisher


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(6, 10, generator=g)
    return {
        "embed.weight": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "layer.0.w": wide[:, ::2],  # not contiguous
        "layer.0.b": torch.randn(3, generator=g, dtype=torch.float64),
        "half": torch.randn(2, 3, generator=g).half(),
        "ids": torch.randint(-9, 9, (4,), generator=g),
        "small": torch.randint(-9, 9, (5,), generator=g, dtype=torch.int8),
        "mask": torch.rand(3, 2, generator=g) > 0.5,
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def test_the_safetensors_package_reads_what_we_write(tmp_path):
    path = tmp_path / "m.safetensors"
    assert write(path, tensors(0), metadata={"format": "pt"}) is False  # a new file
    assert_equal(load_file(path), tensors(0))


def test_the_same_layout_is_overwritten_in_place_and_another_one_written_anew(tmp_path):
    path = tmp_path / "m.safetensors"
    write(path, tensors(0))
    inode, size = os.stat(path).st_ino, os.path.getsize(path)
    assert write(path, tensors(1)) is True
    assert (os.stat(path).st_ino, os.path.getsize(path)) == (inode, size)
    assert_equal(load_file(path), tensors(1))
    # Another shape, dtype or order: the file is written whole again.
    for other in ({**tensors(2), "ids": torch.arange(5)},
                  {**tensors(2), "half": tensors(2)["half"].float()},
                  dict(reversed(tensors(2).items()))):
        assert write(path, other) is False
        assert_equal(load_file(path), other)
    # A file cut short (a crash mid-write) has the header but not the size: written anew.
    write(path, tensors(0))
    with open(path, "r+b") as f:
        f.truncate(size - 4)
    assert write(path, tensors(3)) is False
    assert_equal(load_file(path), tensors(3))


def test_we_map_what_the_safetensors_package_writes(tmp_path):
    path = tmp_path / "m.safetensors"
    want = {k: v.contiguous() for k, v in tensors(4).items()}
    save_file(want, path, metadata={"format": "pt"})
    with mapped(path) as got:
        assert_equal(got, want)
        got["ids"][0] = 1000  # the mapping is private: the file keeps its bytes
    assert_equal(load_file(path), want)


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:5], "too short"),
    (lambda b: b[:40], "runs past the file's end"),
    (lambda b: b[:8] + b"}" + b[9:], "not JSON"),
    (lambda b: struct.pack("<Q", 8) + b"[1, 2]  ", "not a JSON object"),
    (lambda b: b.replace(b'"shape"', b'"shapE"', 1), "malformed entry"),
    (lambda b: b[:-2], "do not fit"),
])
def test_a_damaged_file_is_named_not_mapped(tmp_path, damage, message):
    path = tmp_path / "m.safetensors"
    write(path, tensors(0))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(SafetensorsFormatError, match=message), mapped(path):
        pass


def test_a_dtype_we_do_not_name_is_an_error_and_the_engine_reads_it_with_safetensors(tmp_path):
    from asyncrl.inference.server.model import mapped_checkpoint

    want = {"a": torch.randn(4, 4).to(torch.float8_e4m3fn), "b": torch.randn(3)}
    save_file(want, tmp_path / "model.safetensors")
    with pytest.raises(SafetensorsFormatError, match="F8_E4M3"), mapped(tmp_path / "model.safetensors"):
        pass
    with mapped_checkpoint(str(tmp_path), {"a": (4, 4), "b": (3,)}) as got:
        assert got["a"].view(torch.uint8).equal(want["a"].view(torch.uint8))
        assert got["b"].equal(want["b"])


# ---- the publisher's spare folder ------------------------------------------------------------

class Saver:
    """A trainer whose version-N weights are tensors(N), written as the HF writer does."""

    def __init__(self) -> None:
        self.version = 0

    def save_hf(self, path: str, dtype=None) -> None:
        os.makedirs(path, exist_ok=True)
        write(os.path.join(path, "model.safetensors"), tensors(self.version))
        with open(os.path.join(path, "config.json"), "w") as f:
            f.write(f'{{"version": {self.version}}}')


class Servers:
    """The servers' side: what each load read, copied."""

    def __init__(self) -> None:
        self.loaded: dict[int, dict[str, torch.Tensor]] = {}
        self.inodes: dict[int, int] = {}

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        file = os.path.join(path, "model.safetensors")
        with safetensors_file.mapped(file) as views:
            self.loaded[version] = {k: v.clone() for k, v in views.items()}
        self.inodes[version] = os.stat(file).st_ino


def test_the_publisher_writes_each_version_over_the_oldest_pruned_one(tmp_path):
    servers, saver = Servers(), Saver()
    publisher = WeightPublisher(tmp_path, servers, keep_last=2)
    for version in range(1, 7):
        saver.version = version
        publisher.publish(saver, version)
        assert_equal(servers.loaded[version], tensors(version))
        assert (tmp_path / f"v{version}" / "config.json").read_text() == f'{{"version": {version}}}'
    # v1 became the spare when v3 was loaded, and v4 was written into it; and so on.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spare", "v5", "v6"]
    assert servers.inodes[4] == servers.inodes[1] and servers.inodes[5] == servers.inodes[2]
    assert len({servers.inodes[v] for v in (1, 2, 3)}) == 3
    assert_equal(load_file(tmp_path / "v5" / "model.safetensors"), tensors(5))
    assert_equal(load_file(tmp_path / "v6" / "model.safetensors"), tensors(6))
