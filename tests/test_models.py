"""Our model families equal Hugging Face transformers (CPU, fp32) through the paged KV cache;
the HF name mapping round-trips; the loader names the bad tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.core import InvalidRequestError, StateError
from inference.models import build_model
from inference.models.hf_config import read_model_config
from inference.models.loader import hf_tensor_shapes, load_weights
from inference.models.naming import expected_hf_tensors, hf_to_param, is_skipped, param_to_hf
from inference.parallel import TPInfo
from tests.helpers_models import (
    CASES,
    ToyPager,
    hf_logits,
    load_ours,
    make_hf_checkpoint,
    our_logits,
    random_prompts,
)

ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[str, Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, make_hf_checkpoint(request.param, path)


@pytest.mark.slow
def test_prefill_then_decode_match_transformers(checkpoint: tuple[str, Path, torch.nn.Module]) -> None:
    case, path, hf = checkpoint
    model = load_ours(path)
    prompts = random_prompts([5, 11, 1, 8], model.config.vocab_size)
    pager = ToyPager(num_blocks=48, block_size=4)
    got = our_logits(model, pager, dict(enumerate(prompts)))
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(got[i], hf_logits(hf, prompt), atol=ATOL, rtol=0, msg=f"{case} seq {i}")
    # Two decode steps, one token per sequence, attending through the cache.
    for step in range(2):
        nxt = random_prompts([1] * len(prompts), model.config.vocab_size, seed=10 + step)
        got = our_logits(model, pager, dict(enumerate(nxt)))
        for i in range(len(prompts)):
            prompts[i] = prompts[i] + nxt[i]
            torch.testing.assert_close(got[i][-1], hf_logits(hf, prompts[i])[-1], atol=ATOL, rtol=0,
                                       msg=f"{case} decode {step} seq {i}")


def test_chunked_prefill_mixed_with_decode(tmp_path: Path) -> None:
    """A prompt prefilled in two chunks, in a step that also decodes another sequence."""
    hf = make_hf_checkpoint("llama", tmp_path)
    model = load_ours(tmp_path)
    a, b = random_prompts([13, 6], model.config.vocab_size)
    pager = ToyPager(num_blocks=48, block_size=4, seed=3)
    first = our_logits(model, pager, {0: a[:6], 1: b[:5]})
    second = our_logits(model, pager, {0: a[6:], 1: b[5:]})
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    torch.testing.assert_close(torch.cat([first[0], second[0]]), ref_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([first[1], second[1]]), ref_b, atol=ATOL, rtol=0)


def test_config_reads_what_transformers_writes(checkpoint: tuple[str, Path, torch.nn.Module]) -> None:
    case, path, hf = checkpoint
    c, h = read_model_config(path), hf.config
    assert (c.vocab_size, c.hidden_size, c.num_layers) == (h.vocab_size, h.hidden_size, h.num_hidden_layers)
    assert (c.num_heads, c.num_kv_heads) == (h.num_attention_heads, h.num_key_value_heads)
    assert c.head_dim == (32 if case in ("qwen3", "qwen3_moe") else 16)
    assert c.tie_word_embeddings == (case == "qwen2")
    assert c.qkv_bias == (case == "qwen2")
    assert c.qk_norm == (case in ("qwen3", "qwen3_moe"))
    if case == "qwen3_moe":
        assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 2, 48)
        assert (c.norm_topk_prob, c.dense_layers) == (False, (1,))
    if case == "mixtral":
        assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (6, 2, 96)
        assert (c.norm_topk_prob, c.dense_layers) == (True, ())
    if case not in ("qwen3_moe", "mixtral"):
        assert c.num_experts == 0 and not c.is_moe_layer(0)
    assert c.sliding_window == (4 if case == "mistral" else None)
    assert c.rope.theta == h.rope_parameters["rope_theta"]
    if case == "llama3":
        assert (c.rope.kind, c.rope.factor, c.rope.original_max_position_embeddings) == ("llama3", 8.0, 32)


def test_naming_round_trip_covers_the_checkpoint(checkpoint: tuple[str, Path, torch.nn.Module]) -> None:
    _, path, hf = checkpoint
    config = read_model_config(path)
    model = build_model(config, TPInfo(), torch.float32, "cpu")
    covered: dict[str, tuple[str, object]] = {}
    for name, _ in model.named_parameters():
        for hf_name, shard_id in param_to_hf(name, config):
            assert hf_to_param(hf_name, config) == (name, shard_id)
            covered[hf_name] = (name, shard_id)
    expected = expected_hf_tensors(config)
    assert set(covered) == set(expected)
    # What the checkpoint holds (transformers 5 holds MoE experts fused in memory, but writes one
    # tensor per expert and projection, as the hub's checkpoints are).
    hf_shapes = {k: v for k, v in hf_tensor_shapes(path).items() if not is_skipped(k, config)}
    assert hf_shapes == expected
    ours = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for name, tensor in hf.state_dict().items():
        if ".experts." in name or ".mlp.gate." in name:  # our fused experts are transformers 5's
            assert ours[name] == tuple(tensor.shape), name
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert "lm_head.weight" in hf.state_dict() and is_skipped("lm_head.weight", config)
    # The rotary table is a real buffer, never a weight: no sync refills it, no checkpoint holds it.
    assert "model.rotary_emb.cos_sin_cache" in dict(model.named_buffers())
    assert not any("rotary" in k for k in model.state_dict())


def test_multi_file_checkpoint_with_index(tmp_path: Path) -> None:
    hf = make_hf_checkpoint("qwen2", tmp_path / "one")
    hf.save_pretrained(str(tmp_path / "many"), safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "many" / "model.safetensors.index.json").is_file()
    # A stray file not named by the index (like Mistral's consolidated.safetensors) is not read.
    save_file({"junk": torch.zeros(1)}, str(tmp_path / "many" / "consolidated.safetensors"))
    one, many = load_ours(tmp_path / "one"), load_ours(tmp_path / "many")
    for (n1, p1), (n2, p2) in zip(one.named_parameters(), many.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def _rewrite(path: Path, edit: dict[str, torch.Tensor | None]) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    for name, value in edit.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize(("edit", "culprit", "words"), [
    ({"model.layers.1.self_attn.x_proj.weight": torch.zeros(4, 64)},
     "model.layers.1.self_attn.x_proj.weight", "unknown"),
    ({"model.layers.2.mlp.up_proj.weight": torch.zeros(96, 64)},
     "model.layers.2.mlp.up_proj.weight", "unknown"),
    ({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)},
     "model.layers.0.self_attn.k_proj.weight", "shape"),
    ({"model.layers.1.mlp.gate_proj.weight": None}, "model.layers.1.mlp.gate_proj.weight", "missing"),
    ({"lm_head.weight": None}, "lm_head.weight", "missing"),
])
def test_loader_errors_name_the_tensor_and_write_nothing(
        tmp_path: Path, edit: dict[str, torch.Tensor | None], culprit: str, words: str) -> None:
    make_hf_checkpoint("llama", tmp_path)
    _rewrite(tmp_path, edit)
    model = build_model(read_model_config(tmp_path), TPInfo(), torch.float32, "cpu")
    for p in model.parameters():
        p.data.fill_(7.0)
    with pytest.raises(InvalidRequestError) as err:
        load_weights(model, tmp_path)
    assert err.value.field == culprit
    assert words in err.value.message
    assert all(bool((p == 7.0).all()) for p in model.parameters()), "a failed load overwrote weights"


def test_tied_checkpoint_carrying_lm_head_loads(tmp_path: Path) -> None:
    hf = make_hf_checkpoint("qwen2", tmp_path)
    _rewrite(tmp_path, {"lm_head.weight": hf.lm_head.weight.detach().clone()})
    model = load_ours(tmp_path)
    torch.testing.assert_close(model.lm_head.weight, hf.lm_head.weight, atol=0, rtol=0)


def test_forward_without_kv_cache_is_a_clear_error(tmp_path: Path) -> None:
    make_hf_checkpoint("llama", tmp_path)
    model = load_ours(tmp_path)
    model.unbind_kv_cache()
    input_ids, positions, meta = ToyPager(8, 4).step({0: [1, 2, 3]})
    with pytest.raises(StateError, match="bind_kv_cache"):
        model(input_ids, positions, meta)


def test_heads_not_divisible_by_tp_size_is_a_clear_error(tmp_path: Path) -> None:
    make_hf_checkpoint("llama", tmp_path)
    config = read_model_config(tmp_path)  # 4 heads, 2 kv heads
    with pytest.raises(InvalidRequestError, match="num_key_value_heads = 2 does not divide by"):
        build_model(config, TPInfo(rank=0, size=4, group=object()), torch.float32, "cpu")


def test_kv_cache_views_are_bound_without_copies(tmp_path: Path) -> None:
    make_hf_checkpoint("qwen3", tmp_path)
    model = build_model(read_model_config(tmp_path), TPInfo(), torch.float32, "cpu")
    spec = model.kv_cache_spec()
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (2, 2, 32)
    kv = torch.zeros(spec.shape(num_blocks=5, block_size=4))
    assert spec.bytes_per_block(4, torch.float32) == kv.numel() * 4 // 5
    model.bind_kv_cache(kv)
    for i, attn in enumerate(model.attention_layers()):
        assert attn.k_cache.data_ptr() == kv[0, i].data_ptr()
        assert attn.v_cache.data_ptr() == kv[1, i].data_ptr()
