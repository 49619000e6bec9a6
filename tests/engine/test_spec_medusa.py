"""Medusa heads: their checkpoints (vLLM's and the original repository's layouts), `ferry
train-draft`'s parts on the real SmolLM2 (the hidden states it records are the ones that sampled
each token; training teaches the heads what the model says next), and speculation with trained
heads through whole engine steps: greedy output token-exact with speculation off, alone, batched
and under preemption, with heads that are mostly right and heads that are mostly wrong; seeded
sampling the same tokens; every KV block freed."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_no_blocks_referenced, engine_over, run_to_completion, tiny_llama
from safetensors.torch import save_file
from test_spec_decode_engine import seeded_outputs, spec_prompts
from test_spec_draft_model import generate  # stops at 40 tokens, before a near tie

from ferry.config import EngineArgs
from ferry.engine.llm_engine import LLMEngine
from ferry.layers.gguf_linear import GEMM_MIN_ROWS, exact_prompt_rows
from ferry.sampling_params import SamplingParams
from ferry.tools.train_draft import IGNORE, generate_with_hidden, head_accuracy, train, training_pairs
from ferry.worker.spec_decode.medusa import MedusaHeads


def medusa(path, k: int = 3, length: str = "fixed") -> str:
    return json.dumps({"method": "medusa", "model": str(path), "num_speculative_tokens": k, "draft_length": length})


def random_heads(num_layers: int = 2, scale: float = 0.3, **kw) -> MedusaHeads:
    heads = MedusaHeads(16, kw.pop("vocab", 40), 2, num_layers, **kw)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return heads


def test_checkpoints_round_trip_in_both_layouts(tmp_path):
    h = torch.randn(5, 16)
    lm = torch.randn(40, 16)
    shared = random_heads()
    shared.save(tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["num_heads"] == 2 and config["num_hidden_layers"] == 2 and config["shares_target_lm_head"]
    back = MedusaHeads.load(tmp_path / "ours", 16, 40)
    assert back.lm_heads is None
    assert torch.equal(back.logits(h, lambda x: x @ lm.T), shared.logits(h, lambda x: x @ lm.T))

    # The original Medusa repository's names, with LM heads of their own padded past the vocabulary.
    own = random_heads(vocab=48, own_lm_heads=True)
    tensors = {}
    for i, block in enumerate(own.blocks):
        for j, layer in enumerate(block.layers):
            tensors[f"{i}.{j}.linear.weight"] = layer.weight.detach().clone()
            tensors[f"{i}.{j}.linear.bias"] = layer.bias.detach().clone()
        tensors[f"{i}.2.weight"] = own.lm_heads[i].weight.detach().clone()
    (tmp_path / "orig").mkdir()
    save_file(tensors, str(tmp_path / "orig" / "model.safetensors"))
    (tmp_path / "orig" / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 2}))
    back = MedusaHeads.load(tmp_path / "orig", 16, 40)
    assert back.lm_heads is not None
    assert torch.equal(back.logits(h, None), own.logits(h, None)[..., :40])

    with pytest.raises(ValueError, match="hidden size 16"):
        MedusaHeads.load(tmp_path / "ours", 32, 40)
    with pytest.raises(ValueError, match="predict 48 tokens"):
        MedusaHeads.load(tmp_path / "orig", 16, 64)
    with pytest.raises(ValueError, match="config.json and model.safetensors"):
        MedusaHeads.load(tmp_path / "nowhere", 16, 40)
    del tensors["1.1.linear.weight"]
    save_file(tensors, str(tmp_path / "orig" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lack \['blocks.1.layers.1.weight'\]"):
        MedusaHeads.load(tmp_path / "orig", 16, 40)


def test_training_pairs_shift_each_head_one_further():
    hidden = torch.arange(4.0).unsqueeze(1)
    _, targets = training_pairs([(hidden, [10, 11, 12, 13])], num_heads=2)
    assert targets.tolist() == [[11, 12], [12, 13], [13, IGNORE], [IGNORE, IGNORE]]


def test_training_learns_a_rule_the_heads_can_express():
    """Synthetic: head i's target is what a fixed random head of the same form would guess; the
    untrained (identity) heads get few right, the trained ones most."""
    g = torch.Generator().manual_seed(1)
    lm_head = torch.randn(32, 16, generator=g)
    hidden = torch.randn(4096, 16, generator=g)
    teacher = random_heads(num_layers=1, scale=1.0)
    with torch.no_grad():
        targets = teacher.logits(hidden, lambda x: x @ lm_head.T).argmax(-1).T  # [N, heads]
    heads = MedusaHeads(16, 32, num_heads=2, num_layers=1)
    before = head_accuracy(heads, lm_head, hidden, targets)
    train(heads, lm_head, hidden, targets, epochs=20, batch_size=256, lr=3e-2, seed=0)
    after = head_accuracy(heads, lm_head, hidden, targets)
    assert max(before) < 0.3 and min(after) > 0.8, (before, after)


def test_dense_lm_head_is_the_models_head(smollm_gguf):
    model = smollm_gguf.model
    h = torch.randn(GEMM_MIN_ROWS, model.config.hidden_size)  # fewer rows take the int8 dots
    dense = model.dense_lm_head()
    assert dense.shape == (model.config.vocab_size, model.config.hidden_size)
    with exact_prompt_rows():
        want = model.compute_logits(h)
    torch.testing.assert_close(h @ dense.T, want, atol=1e-3, rtol=1e-4)


@pytest.fixture(scope="module")
def prompts(smollm):
    return spec_prompts(smollm.tokenizer)


@pytest.fixture(scope="module")
def reference(smollm_gguf, prompts):
    return generate(engine_over(smollm_gguf), prompts)


@pytest.fixture(scope="module")
def trained_heads(smollm_gguf, prompts, tmp_path_factory):
    """Heads trained on the model's answers to the test prompts themselves (what they then serve:
    mostly right), and the untrained ones (identity heads guessing the token just sampled: mostly
    wrong); (directory, held accuracy before, after)."""
    engine = engine_over(smollm_gguf)
    answers = generate_with_hidden(
        engine, list(prompts.values()), SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    )
    hidden, targets = training_pairs(answers, num_heads=3)
    lm_head = smollm_gguf.model.dense_lm_head()
    heads = MedusaHeads(smollm_gguf.model.config.hidden_size, smollm_gguf.model.config.vocab_size, 3)
    root = tmp_path_factory.mktemp("medusa")
    heads.save(root / "untrained")
    before = head_accuracy(heads, lm_head, hidden, targets)
    train(heads, lm_head, hidden, targets, epochs=2, batch_size=64, lr=3e-3, seed=0)
    heads.save(root / "half-trained")  # first guesses right ~40% of the time, second or third ~10%
    heads = MedusaHeads(smollm_gguf.model.config.hidden_size, smollm_gguf.model.config.vocab_size, 3)
    train(heads, lm_head, hidden, targets, epochs=12, batch_size=64, lr=3e-3, seed=0)
    heads.save(root / "trained")
    return root, before, head_accuracy(heads, lm_head, hidden, targets), answers


def test_recorded_hidden_states_are_the_ones_that_sampled(smollm_gguf, trained_heads):
    *_, answers = trained_heads
    for hidden, tokens in answers:
        assert len(hidden) == len(tokens) == 64
        assert smollm_gguf.model.compute_logits(hidden).argmax(-1).tolist() == tokens


def test_trained_heads_speculate_token_exact(smollm_gguf, prompts, reference, trained_heads):
    root, before, after, _ = trained_heads
    assert after[0] > 0.5 > before[0], (before, after)  # they learnt what the model says next
    engine = engine_over(smollm_gguf, speculative_config=medusa(root / "trained"))
    assert generate(engine, {"edit": prompts["edit"]}) == {"edit": reference["edit"]}
    assert generate(engine, prompts) == reference
    stats = engine.get_stats()
    assert stats.spec_num_accepted_tokens > 0.4 * stats.spec_num_draft_tokens > 0
    assert_no_blocks_referenced(engine)
    # Too few blocks for the three at once: preempted requests recompute, then draft again.
    engine = engine_over(smollm_gguf, speculative_config=medusa(root / "trained"), num_kv_blocks=12)
    assert generate(engine, prompts) == reference
    assert engine.get_stats().num_preemptions > 0
    assert_no_blocks_referenced(engine)

    engine = engine_over(smollm_gguf, speculative_config=medusa(root / "untrained"))
    assert generate(engine, prompts) == reference
    stats = engine.get_stats()
    assert stats.spec_num_draft_tokens > 100 and stats.spec_num_accepted_tokens < 0.2 * stats.spec_num_draft_tokens
    assert_no_blocks_referenced(engine)


TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 1, 0], [1, 0, 0]]


@pytest.mark.parametrize("gguf", [True, False], ids=["cpp-step", "python-layers"])
def test_tree_of_guesses_is_token_exact(smollm, smollm_gguf, prompts, reference, trained_heads, gguf, monkeypatch):
    """Each head's top guesses as a tree (TREE), verified in one pass with the ancestor mask: the
    output is the model's own (the kept path's K/V moved into place, or later tokens would go
    wrong), paths off the first guesses are kept, and the preempted and batched runs agree.
    Through the C++ decode step (GGUF) and the Python layer loop (fp32 weights)."""
    loaded = smollm_gguf if gguf else smollm
    want = reference if gguf else generate(engine_over(smollm), prompts)
    root, *_ = trained_heads
    config = json.loads(medusa(root / "half-trained"))
    config["speculative_token_tree"] = TREE
    moved = []
    engine = engine_over(loaded, speculative_config=json.dumps(config))
    runner = engine.core.runner
    original = runner._move_kept_drafts
    monkeypatch.setattr(runner, "_move_kept_drafts", lambda s, r, kept: (moved.append(kept), original(s, r, kept)))
    assert generate(engine, prompts) == want
    stats = engine.get_stats()
    assert stats.spec_num_draft_tokens >= 6 * stats.spec_num_drafts > 0  # trees (a chain has 3 at most)
    off_chain = [nodes for step in moved for nodes in step if nodes != list(range(1, len(nodes) + 1))]
    assert len(off_chain) >= 3, off_chain
    assert_no_blocks_referenced(engine)
    engine = engine_over(loaded, speculative_config=json.dumps(config), num_kv_blocks=12)
    assert generate(engine, prompts) == want
    assert engine.get_stats().num_preemptions > 0
    assert_no_blocks_referenced(engine)


def test_seeded_sampling_and_limits(smollm_gguf, prompts, reference, trained_heads):
    root, *_ = trained_heads
    chosen = {name: prompts[name] for name in ("edit", "story")}
    want = seeded_outputs(engine_over(smollm_gguf), chosen, seeds=3, max_tokens=30)
    engine = engine_over(smollm_gguf, speculative_config=medusa(root / "trained", length="adaptive"))
    assert seeded_outputs(engine, chosen, seeds=3, max_tokens=30) == want
    ids, greedy = prompts["edit"], reference["edit"]
    for n in (1, 2, 5):
        assert generate(engine, {"edit": ids}, max_tokens=n)["edit"] == greedy[:n]
    stop = greedy[9]
    assert generate(engine, {"edit": ids}, stop_token_ids=[stop])["edit"] == greedy[: greedy.index(stop) + 1]
    assert_no_blocks_referenced(engine)


def test_bad_medusa_configs_are_clear_errors(smollm, trained_heads, tmp_path):
    root, *_ = trained_heads
    with pytest.raises(ValueError, match="exceeds the 3 Medusa heads"):
        engine_over(smollm, speculative_config=medusa(root / "trained", k=4))
    with pytest.raises(ValueError, match="need a `model`"):
        engine_over(smollm, speculative_config='{"method": "medusa", "num_speculative_tokens": 2}')
    with pytest.raises(ValueError, match="config.json and model.safetensors"):
        engine_over(smollm, speculative_config=medusa(tmp_path))
    for tree, words in (([[0], [0, 1, 1]], "lacks its parent"), ([[0, 0, 0, 0]], "deeper than"),
                        ([[i] for i in range(65)], "at most 64"), ("[(0,), (-1,)]", "ranks >= 0")):  # fmt: skip
        config = json.loads(medusa(root / "trained"))
        config["speculative_token_tree"] = tree
        with pytest.raises(ValueError, match=words):
            engine_over(smollm, speculative_config=json.dumps(config))
    with pytest.raises(ValueError, match="is for the medusa method"):
        engine_over(smollm, speculative_config='{"num_speculative_tokens": 2, "speculative_token_tree": [[0]]}')


def test_train_draft_command_rejects_bad_arguments(tmp_path, capsys):
    from ferry.cli import main

    assert main(["train-draft", "--output", str(tmp_path), "--num-prompts", "0"]) == 2
    assert "--num-prompts must be in [1, 400]" in capsys.readouterr().err
    assert main(["train-draft", "--output", str(tmp_path), "--eval-fraction", "1"]) == 2
    assert not any(tmp_path.iterdir())  # nothing loaded, nothing written


@pytest.mark.parametrize("case", ["int8", "fp8", "window-4", "window-2"])
def test_trees_on_quantized_caches_and_sliding_windows_are_token_exact(case, tmp_path, monkeypatch):
    """A tiny random model and random heads (a tree's off-chain paths often kept): greedy tokens with a
    tree are the tokens without speculation. int8 / fp8: a kept path's K/V moved within a quantized
    cache's block layout (its slots are not rows of the tensor). window-N: every layer windowed, the
    window counted from a node's position (its depth), not its slot, keys and ancestors alike."""
    kv_dtype = case if not case.startswith("window") else "auto"
    window = int(case.split("-")[1]) if case.startswith("window") else None
    model = tiny_llama(sliding_window=window)
    torch.manual_seed(3)
    MedusaHeads(model.config.hidden_size, model.config.vocab_size, 3, 1).save(tmp_path)
    config = json.loads(medusa(tmp_path))
    config["speculative_token_tree"] = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(3, 13, (6,), generator=g)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs, moved = {}, []
    for spec in (None, json.dumps(config)):
        args = EngineArgs(model="tiny", device="cpu", dtype="float32", block_size=4, num_kv_blocks=128,
                          attention_backend="torch", kv_cache_dtype=kv_dtype, speculative_config=spec)  # fmt: skip
        engine = LLMEngine(args, model=model, tokenizer=None, device=torch.device("cpu"), dtype=torch.float32)
        if spec is not None:
            runner = engine.core.runner
            original = runner._move_kept_drafts
            monkeypatch.setattr(runner, "_move_kept_drafts",
                                lambda s, r, kept, f=original: (moved.append(kept), f(s, r, kept)))  # fmt: skip
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": ids}, greedy)
        done = run_to_completion(engine)
        outputs[spec is not None] = [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]
        assert_no_blocks_referenced(engine)
    off_chain = [nodes for step in moved for nodes in step if nodes != list(range(1, len(nodes) + 1))]
    assert len(off_chain) >= 3, off_chain  # the case under test happened
    assert outputs[True] == outputs[False]
