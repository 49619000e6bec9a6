"""models/shard_reader.py: a safetensors checkpoint read by several threads, in order, with a bounded
read-ahead."""

from __future__ import annotations

import safetensors
import torch
from safetensors.torch import save_file

from ferry.models.shard_reader import read_ahead, tensor_bytes


def shards(tmp_path, files: int = 3, per_file: int = 6) -> tuple[list[tuple[str, str]], list[int], dict]:
    gen = torch.Generator().manual_seed(0)
    entries, sizes, tensors = [], [], {}
    for i in range(files):
        path = str(tmp_path / f"model-{i}.safetensors")
        dtypes = (torch.float32, torch.bfloat16)
        part = {f"layers.{i}.w{j}": torch.randn(16, 16 + j, generator=gen).to(dtypes[j % 2]) for j in range(per_file)}
        save_file(part, path)
        tensors.update(part)
        names = list(part)
        entries += [(path, n) for n in names]
        sizes += tensor_bytes(path, names)
    return entries, sizes, tensors


def test_read_ahead_gives_every_tensor_in_checkpoint_order(tmp_path):
    entries, sizes, tensors = shards(tmp_path)
    assert sizes == [t.numel() * t.element_size() for t in tensors.values()]
    got = list(read_ahead(entries, sizes, workers=4))
    assert [name for name, _ in got] == [name for _, name in entries]
    for name, t in got:
        assert t.dtype == tensors[name].dtype and torch.equal(t, tensors[name])


def test_read_ahead_holds_at_most_its_bound_and_stops_with_its_consumer(tmp_path, monkeypatch):
    entries, sizes, _ = shards(tmp_path)
    reads = []
    real_open = safetensors.safe_open

    class Counting:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def get_tensor(self, name):
            reads.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Counting)
    bound = sizes[0] + sizes[1]  # two tensors' worth of read-ahead
    it = read_ahead(entries, sizes, workers=4, max_bytes=bound)
    first = [next(it) for _ in range(3)]
    it.close()  # the consumer stops: nothing more is read, and the threads are gone
    assert [n for n, _ in first] == [n for _, n in entries[:3]]
    assert len(reads) <= 3 + 2, reads  # what was taken, plus at most the bound's worth ahead
    one = list(read_ahead(entries[:2], sizes[:2], workers=2, max_bytes=1))  # below one tensor: one at a time
    assert [n for n, _ in one] == [n for _, n in entries[:2]]
