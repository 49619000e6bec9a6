"""The `prefix` policy's memory: which worker was sent which prompt prefixes.

An approximate radix tree at block granularity: block hashes are chained (each
one names its whole prefix), so a map from block hash to the workers it was
routed to is a trie whose paths are prompts. It is approximate because it
knows what the gateway sent, not what each replica still caches, and it is
bounded: past `max_blocks` entries the least recently used are forgotten.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixIndex:
    def __init__(self, max_blocks: int = 200_000) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def overlap(self, block_hashes: list[bytes], worker: str) -> int:
        """Leading blocks of the prompt routed to `worker` before."""
        n = 0
        for h in block_hashes:
            workers = self._blocks.get(h)
            if workers is None or worker not in workers:
                break
            n += 1
        return n

    def insert(self, block_hashes: list[bytes], worker: str) -> None:
        """Remember the prompt went to `worker` (and refresh its blocks in the LRU). Last block
        first, so a prompt's leading blocks are the most recent and the tails of chains are
        forgotten before their heads (a lost head would make the whole chain unreachable)."""
        for h in reversed(block_hashes):
            workers = self._blocks.get(h)
            if workers is None:
                self._blocks[h] = {worker}
            else:
                workers.add(worker)
                self._blocks.move_to_end(h)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def forget_worker(self, worker: str) -> None:
        """A worker left (or restarted): its cache is gone."""
        for h in [h for h, ws in self._blocks.items() if worker in ws]:
            ws = self._blocks[h]
            ws.discard(worker)
            if not ws:
                del self._blocks[h]
