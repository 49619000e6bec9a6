"""Medusa heads (Cai et al., 2024): small residual MLPs on the target's last hidden state, head i
guessing the token i + 2 places ahead of the one that hidden state predicts, all at once: drafts
for the price of a few tiny matmuls and one LM-head GEMM over k rows (the weights read once).

A head is `x + SiLU(W x + b)`, repeated `num_hidden_layers` times, then an LM head: its own
(`lm_heads.{i}.weight`) or, with none in the file, the target's, shared and run through the
target's kernels (a GGUF head stays quantized). Checkpoints: a directory with config.json and
model.safetensors in vLLM's layout (`blocks.{i}.layers.{j}.weight`/`.bias`, `lm_heads.{i}.weight`;
config keys `num_heads`, `num_hidden_layers`, `hidden_size`, `vocab_size`) or the original
Medusa repository's names (`{i}.{j}.linear.weight`, `{i}.{L}.weight`; `medusa_num_heads`,
`medusa_num_layers`). `ferry train-draft --method medusa` (ferry/tools/train_draft.py) writes
the first layout with the blocks only.

The heads draft from the hidden state of the row whose draw was a request's last token (the
runner keeps it: `ModelRunner.logits_hidden`, `last_row_of`), so a request that sampled in the
previous step gets drafts and one that did not (a prompt a prefill worker computed) gets none
until it has. A chain takes each head's draw (`Sampler.draft`, as the target will draw); with a
tree (`speculative_token_tree`) a greedy request's drafts are each head's top guesses by rank
along the tree's paths (the raw logits' order), verified together (step_plan.py).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ferry.core.request import Request
from ferry.worker.model_runner import ModelRunner
from ferry.worker.sampler import Sampler

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class ResidualBlock(nn.Module):
    """One head's body: `x + SiLU(W x + b)`, `num_layers` times (vLLM's parameter names)."""

    def __init__(self, hidden_size: int, num_layers: int, bias: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers))
        for layer in self.layers:  # a fresh head starts as the identity: it guesses what the LM head does
            nn.init.zeros_(layer.weight)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    """`num_heads` heads of `num_layers` residual blocks each, and their LM heads (None: the
    target's)."""

    def __init__(
        self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1, bias: bool = True,
        own_lm_heads: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        if num_heads < 1 or num_layers < 1:
            raise ValueError(f"Medusa needs at least one head of one layer, got {num_heads} x {num_layers}")
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.num_layers = num_layers
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size, num_layers, bias) for _ in range(num_heads))
        self.lm_heads = (
            nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))
            if own_lm_heads
            else None
        )

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """[B, H] -> [num_heads, B, H]: each head's input to its LM head (the first `num_heads`)."""
        return torch.stack([block(hidden) for block in self.blocks[:num_heads]])

    def logits(self, hidden: torch.Tensor, target_logits, num_heads: int | None = None) -> torch.Tensor:
        """[B, H] -> [num_heads, B, V] (the first `num_heads`); `target_logits` is the target's LM
        head (used when the heads have none of their own), taking all heads' rows in one call."""
        states = self(hidden, num_heads)
        if self.lm_heads is None:
            k, b, h = states.shape
            return target_logits(states.reshape(k * b, h)).view(k, b, -1)
        return torch.stack([F.linear(s, head.weight) for s, head in zip(states, self.lm_heads)])

    # -- checkpoints ---------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write config.json and model.safetensors (vLLM's names) into directory `path`."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        bias = self.blocks[0].layers[0].bias is not None
        config = {
            "model_type": "medusa",
            "architectures": ["MedusaModel"],
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_heads": self.num_heads,
            "num_hidden_layers": self.num_layers,
            "medusa_fc_bias": bias,
            # ferry's: no LM heads in the file, the target's is used
            "shares_target_lm_head": self.lm_heads is None,
        }
        (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        tensors = {name: t.detach().float().contiguous() for name, t in self.state_dict().items()}
        save_file(tensors, str(path / WEIGHTS_FILE))

    @classmethod
    def load(cls, path: str | Path, hidden_size: int, vocab_size: int) -> MedusaHeads:
        """Heads from a checkpoint directory (see the module docstring), checked against the
        target's hidden and vocabulary sizes."""
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
            raise ValueError(f"Medusa heads {str(path)!r}: need a directory with {CONFIG_FILE} and {WEIGHTS_FILE}")
        config = json.loads((path / CONFIG_FILE).read_text())
        tensors = {_vllm_name(k): v for k, v in load_file(str(path / WEIGHTS_FILE)).items()}
        tensors = {k.removeprefix("medusa_heads."): v for k, v in tensors.items()}
        num_heads = config.get("num_heads", config.get("medusa_num_heads"))
        num_layers = config.get("num_hidden_layers", config.get("medusa_num_layers", 1))
        if not isinstance(num_heads, int):
            num_heads = 1 + max((int(k.split(".")[1]) for k in tensors if k.startswith("blocks.")), default=-1)
        h = config.get("hidden_size", hidden_size)
        if h != hidden_size:
            raise ValueError(f"Medusa heads {str(path)!r} take hidden size {h}, the model's is {hidden_size}")
        bias = "blocks.0.layers.0.bias" in tensors
        own = "lm_heads.0.weight" in tensors
        heads = cls(hidden_size, vocab_size, num_heads, num_layers, bias=bias, own_lm_heads=own)
        if own:
            rows = tensors["lm_heads.0.weight"].shape[0]
            if rows < vocab_size:
                raise ValueError(f"Medusa heads {str(path)!r} predict {rows} tokens, the model has {vocab_size}")
            for i in range(num_heads):  # rows past the target's vocabulary are padding it cannot take
                tensors[f"lm_heads.{i}.weight"] = tensors[f"lm_heads.{i}.weight"][:vocab_size]
        wanted = heads.state_dict()
        missing = sorted(set(wanted) - set(tensors))
        if missing:
            raise ValueError(f"Medusa heads {str(path)!r} lack {missing[:4]}{'...' if len(missing) > 4 else ''}")
        for name, tensor in tensors.items():
            if name in wanted and tuple(tensor.shape) != tuple(wanted[name].shape):
                raise ValueError(
                    f"Medusa heads {str(path)!r}: {name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(wanted[name].shape)}"
                )
        heads.load_state_dict({k: tensors[k] for k in wanted})
        return heads


def _vllm_name(name: str) -> str:
    """The original Medusa repository's names ({i}.{j}.linear.weight for block j of head i, and
    {i}.{L}.weight for its LM head after L blocks) in vLLM's layout; others unchanged."""
    m = re.fullmatch(r"(\d+)\.(\d+)\.linear\.(weight|bias)", name)
    if m:
        return f"blocks.{m[1]}.layers.{m[2]}.{m[3]}"
    m = re.fullmatch(r"(\d+)\.(\d+)\.weight", name)
    if m:
        return f"lm_heads.{m[1]}.weight"
    return name


class MedusaProposer:
    """`propose` drafts, for each request that sampled in the target's last step, one token per
    head from the hidden state that sampled it, drawn as the target's verify row will draw
    (`Sampler.draft`: the request's processing and the same noise)."""

    def __init__(
        self,
        heads: MedusaHeads,
        runner: ModelRunner,
        max_model_len: int,
        tree: list[tuple[int, ...]] | None = None,
    ) -> None:
        """`tree`: the candidates as sorted paths of ranks (config.py: parse_token_tree); None:
        each head's first guess only, a chain."""
        self.heads = heads
        self.runner = runner  # the target's: its last hidden states and LM head
        self.max_model_len = max_model_len
        # Trees need the decode kernels' ancestor mask (the torch backend and the C++ step have it).
        self.tree = tree if getattr(runner.attn_backend, "supports_tree", False) else None
        self.sampler = Sampler(runner.model.config.vocab_size)
        self._pass_times: list[tuple[int, float]] = []

    def take_pass_times(self) -> list[tuple[int, float]]:
        """The heads' work since the last call as draft passes, one per head run: (requests
        drafted for, seconds), each head an equal share of its call (the adaptive policy prices
        a draft as its verify row plus a pass's share, as for a draft model)."""
        times, self._pass_times = self._pass_times, []
        return times

    @torch.inference_mode()
    def propose(self, requests: list[Request], rooms: list[int]) -> list[list[int]]:
        """Drafts up to rooms[i] deep for requests[i] (each about to decode): a chain, or for a
        greedy request with a tree configured, the tree's nodes in preorder (their parents set in
        `Request.spec_parents`), as many as fit before max_model_len."""
        drafts: list[list[int]] = [[] for _ in requests]
        hidden = self.runner.logits_hidden
        last_row = self.runner.last_row_of()
        index = [(i, last_row.get(r.request_id)) for i, r in enumerate(requests) if rooms[i] > 0]
        index = [(i, row) for i, row in index if row is not None]
        if hidden is None or not index:
            return drafts
        start = time.perf_counter()
        rows = torch.tensor([row for _, row in index], device=hidden.device)
        depth = min(self.heads.num_heads, max(rooms[i] for i, _ in index))
        logits = self.heads.logits(hidden.index_select(0, rows), self.runner.model.compute_logits, depth)
        chosen = [requests[i] for i, _ in index]
        greedy = [n for n, r in enumerate(chosen) if self.tree is not None and r.sampling_params.greedy]
        if greedy:  # their trees: each head's guesses by rank (the raw logits' order)
            ranks = [1 + max((p[j] for p in self.tree if len(p) > j), default=-1) for j in range(depth)]
            top = [logits[j].topk(max(ranks[j], 1), dim=-1).indices.tolist() for j in range(depth)]
            for n in greedy:
                i, request = index[n][0], chosen[n]
                room = min(64, self.max_model_len - request.num_tokens - 1)
                order: dict[tuple[int, ...], int] = {}
                parents: list[int] = []
                for path in self.tree:
                    if len(path) > rooms[i] or len(parents) >= room:
                        continue
                    drafts[i].append(top[len(path) - 1][n][path[-1]])
                    parents.append(order[path[:-1]] if len(path) > 1 else 0)
                    order[path] = len(parents)
                request.spec_parents = parents if drafts[i] else None
        in_trees = set(greedy)
        chains = [n for n in range(len(chosen)) if n not in in_trees]
        for j in range(depth if chains else 0):
            tokens = self.sampler.draft(logits[j], [chosen[n] for n in chains], [drafts[index[n][0]] for n in chains])
            for n, token in zip(chains, tokens):
                i = index[n][0]
                if len(drafts[i]) < rooms[i]:
                    drafts[i].append(token)
        seconds = time.perf_counter() - start  # `tolist` in `draft` waited for the device
        self._pass_times += [(len(index), seconds / depth)] * depth
        return drafts
