"""The embedded tiny model (inference.models.tiny), the tokenizer wrapper and streaming detokenization."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from inference.models.hf_config import read_model_config
from inference.models.tiny import (
    BOS_ID,
    DEFAULT_TINY,
    EOS_ID,
    FAMILIES,
    IM_END_ID,
    TOKENIZER_VOCAB_SIZE,
    TinyModelSpec,
    default_model_dir,
    make_tiny_model,
)
from inference.text.stop_strings import StopDetector, StopStrings
from inference.text.tokenizer import IncrementalDetokenizer, Tokenizer
from sidecar.cli import make_model as make_model_cli

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512}
TEXTS = [
    "Hello world, the miller counted 1234 sacks.",
    "café naïve déjà vu Zürich",
    "emoji 😀🎉 and 👩‍👩‍👧 family, flags 🇫🇷",
    "中文字符 日本語 한국어 Ελληνικά עברית",
    "tabs\tand\nnewlines\r\n  spaces   ",
    "",
]
NON_NFC = "e\u0301 combining accent, \u212b angstrom sign, \x00 nul \x7f del"


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {f: make_tiny_model(root / f, f, rope_scaling=LLAMA3_ROPE if f == "llama" else None)
            for f in FAMILIES}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_family_dir_loads_in_transformers_without_warnings(family: str, family_dirs: dict[str, Path]) -> None:
    import warnings

    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = family_dirs[family]
    handler = _Records()
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
            hf_tok = AutoTokenizer.from_pretrained(d)
    finally:
        hf_logger.removeHandler(handler)
    assert [r.getMessage() for r in handler.records] == []
    assert [str(w.message) for w in caught if not issubclass(w.category, DeprecationWarning)] == []
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(),
                    "error_msgs": []}
    ids = hf_tok("The river ran slowly 😀")["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), TOKENIZER_VOCAB_SIZE)
    assert torch.isfinite(logits).all()
    if family == "llama":
        assert model.config.rope_parameters["rope_type"] == "llama3"


@pytest.mark.parametrize("family", FAMILIES)
def test_our_model_config_reads_the_tiny_config(family: str, family_dirs: dict[str, Path]) -> None:
    mc = read_model_config(family_dirs[family])
    assert mc.family == family
    assert (mc.hidden_size, mc.num_layers, mc.num_heads, mc.num_kv_heads) == (128, 3, 8, 4)
    assert mc.head_dim == 16 and mc.vocab_size == TOKENIZER_VOCAB_SIZE
    assert mc.tie_word_embeddings == (family in ("qwen2", "qwen3"))
    assert mc.qkv_bias == (family == "qwen2") and mc.qk_norm == (family in ("qwen3", "qwen3_moe"))
    assert mc.num_experts == (8 if family in ("qwen3_moe", "mixtral") else 0)
    assert mc.rope.kind == ("llama3" if family == "llama" else "default")
    assert mc.eos_token_ids == (EOS_ID, IM_END_ID) and mc.bos_token_id == BOS_ID
    assert mc.sliding_window is None and mc.dtype == "float32"


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_tokenizer_agrees_with_ours(family: str, family_dirs: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(family_dirs[family])
    ours = Tokenizer.from_dir(family_dirs[family])
    assert ours is not None
    for text in TEXTS:  # NFC text: transformers' Qwen2Tokenizer normalizes to NFC, ours does not
        ids = ours.encode(text)
        assert ids == hf_tok(text)["input_ids"], text
        assert ours.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True) == text


def test_same_settings_give_identical_bytes(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", "qwen3", seed=7, dtype="bfloat16")
    b = make_tiny_model(tmp_path / "b", "qwen3", seed=7, dtype="bfloat16")
    c = make_tiny_model(tmp_path / "c", "qwen3", seed=8, dtype="bfloat16")
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_tokenizer_training_is_deterministic_across_processes() -> None:
    from inference.models.tiny import train_tokenizer

    # Another process has other hash seeds (Python's and the Rust HashMaps' inside `tokenizers`).
    code = ("import hashlib; from inference.models.tiny import train_tokenizer; "
            "print(hashlib.sha256(train_tokenizer().to_str().encode()).hexdigest())")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, check=True,
                         capture_output=True, text=True)
    assert out.stdout.strip() == hashlib.sha256(train_tokenizer().to_str().encode()).hexdigest()
    assert train_tokenizer().to_str() == train_tokenizer().to_str()


def test_weights_have_hf_names_and_shapes(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    d = make_tiny_model(tmp_path / "m", "qwen2", tie_word_embeddings=False, vocab_size=640, head_dim=32)
    w = load_file(str(d / "model.safetensors"))
    assert w["model.embed_tokens.weight"].shape == (640, 128)
    assert w["lm_head.weight"].shape == (640, 128)
    assert w["model.layers.2.self_attn.q_proj.weight"].shape == (8 * 32, 128)
    assert w["model.layers.2.self_attn.k_proj.bias"].shape == (4 * 32,)
    assert w["model.layers.0.self_attn.o_proj.weight"].shape == (128, 8 * 32)
    assert w["model.layers.1.mlp.down_proj.weight"].shape == (128, 256)
    norm = w["model.norm.weight"]
    assert 0.8 < norm.mean().item() < 1.2 and norm.std().item() > 0  # around 1, not constant
    tok = Tokenizer.from_dir(d)
    assert tok is not None and tok.decode([600, 40]) == tok.decode([40])  # padded rows decode to ""


def test_round_trip_of_arbitrary_text(family_dirs: dict[str, Path]) -> None:
    tok = Tokenizer.from_dir(family_dirs["qwen2"])
    assert tok is not None and tok.vocab_size == TOKENIZER_VOCAB_SIZE
    gen = torch.Generator().manual_seed(0)
    random_text = "".join(chr(int(c)) for c in torch.randint(1, 0xD7FF, (200,), generator=gen))
    for text in [*TEXTS, NON_NFC, random_text, "<|endoftext|> is special"]:
        ids = tok.encode(text)
        assert all(0 <= i < TOKENIZER_VOCAB_SIZE for i in ids)
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("<|endoftext|>") == [EOS_ID]
    assert tok.decode([EOS_ID, *tok.encode("hi")]) == "hi"


def test_special_token_conventions(family_dirs: dict[str, Path], tmp_path: Path) -> None:
    qwen, llama = Tokenizer.from_dir(family_dirs["qwen2"]), Tokenizer.from_dir(family_dirs["llama"])
    assert qwen is not None and llama is not None
    assert qwen.eos_token_ids == (EOS_ID, IM_END_ID) and qwen.bos_token_id == BOS_ID
    assert qwen.encode("hi")[0] != BOS_ID
    assert llama.encode("hi")[0] == BOS_ID and llama.encode("hi", add_special_tokens=False)[0] != BOS_ID
    # tokenizer_config's add_bos_token overrides what tokenizer.json's post-processor does.
    for family, flag in (("llama", False), ("qwen2", True)):
        d = make_tiny_model(tmp_path / family, family)
        cfg_path = d / "tokenizer_config.json"
        cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "add_bos_token": flag}))
        tok = Tokenizer.from_dir(d)
        assert tok is not None and (tok.encode("hi")[0] == BOS_ID) == flag
        assert tok.encode("hi")[-len(tok.encode("hi", False)):] == tok.encode("hi", False)
    assert Tokenizer.from_dir(tmp_path) is None  # no tokenizer.json: token ids only


def _stream(tok: Tokenizer, ids: list[int], chunk: int, prompt: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt or [])
    deltas = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text
    return deltas


@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_detokenizer_never_emits_a_split_character(
        family_dirs: dict[str, Path], chunk: int) -> None:
    tok = Tokenizer.from_dir(family_dirs["llama"])
    assert tok is not None
    held_back = False
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        deltas = _stream(tok, ids, chunk, prompt=tok.encode("A prompt: "))
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas), (text, deltas)
        held_back |= any(d == "" for d in deltas[:-1])
    assert held_back  # the emoji and CJK texts do split characters across tokens


def test_incremental_detokenizer_skips_special_tokens_and_emits_invalid_bytes(
        family_dirs: dict[str, Path]) -> None:
    tok = Tokenizer.from_dir(family_dirs["qwen2"])
    assert tok is not None
    hi, smile = tok.encode("hi"), tok.encode("😀")
    assert len(smile) > 1
    assert "".join(_stream(tok, [*hi, EOS_ID, *hi], 1)) == "hihi"
    # A lone continuation byte repeated is invalid UTF-8: it must come out as U+FFFD, not stall.
    cont = smile[-1]
    detok = IncrementalDetokenizer(tok)
    for _ in range(8):
        detok.add([cont])
    assert "\ufffd" in detok.text
    detok.add(hi)
    assert detok.text.endswith("hi")
    # A character still incomplete when the sequence ends is flushed as U+FFFD.
    detok = IncrementalDetokenizer(tok)
    assert detok.add(smile[:1]) == ""
    assert detok.flush() == "\ufffd"


def _sentencepiece_style_dir(path: Path) -> Path:
    """A Llama-2-style tokenizer.json: Metaspace words, byte fallback, a decoder that strips the
    leading space of every decode call (so deltas are only right when decoded in context)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RawTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator(["Hello world, the world is round and the river runs past the mill."] * 3,
                            trainer=trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):  # byte-fallback tokens are ordinary vocabulary entries, as in Llama 2
        vocab[f"<0x{b:02X}>"] = len(vocab)
    path.mkdir()
    (path / "tokenizer.json").write_text(json.dumps(data))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": True, "bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    return path


def test_incremental_detokenizer_with_a_sentencepiece_style_tokenizer(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_sentencepiece_style_dir(tmp_path / "sp"))
    assert tok is not None and tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    prompt = tok.encode("the river")
    assert prompt[0] == 1
    completion = tok.encode(" runs past the world 😀 ok", add_special_tokens=False)
    expected = tok.decode(prompt + completion)[len(tok.decode(prompt)):]
    assert expected == " runs past the world 😀 ok"
    for chunk in (1, 2):
        deltas = _stream(tok, completion, chunk, prompt=prompt)
        assert "".join(deltas) == expected
        assert not any("\ufffd" in d for d in deltas)


def _first_stop(text: str, stops: list[str], pieces: int = 1) -> tuple[int, str] | None:
    """The stop the automaton reports for `text` fed in `pieces` chunks (the first chunk that completes one)."""
    automaton, state, offset = StopStrings(stops), 0, 0
    size = max(1, -(-len(text) // pieces))
    for k in range(0, len(text), size):
        state, hit = automaton.scan(state, text[k:k + size], offset)
        offset += len(text[k:k + size])
        if hit is not None:
            return hit
    return None


def test_stop_strings_earliest_wins_and_ties_go_to_the_first_listed() -> None:
    assert _first_stop("abc STOP def END", ["END", "STOP"]) == (4, "STOP")
    assert _first_stop("abc STOP", ["STOP", "ST"]) == (4, "STOP")
    assert _first_stop("abc STOP", ["ST", "STOP"]) == (4, "ST")
    assert _first_stop("abc STOP", ["TOP", "STOP", "OP"]) == (4, "STOP")  # a longer match starts earlier
    assert _first_stop("abc", ["x"]) is None
    assert _first_stop("xaXb aXb", ["aXb"]) == (1, "aXb")
    assert _first_stop("aaab", ["aab", "ab", "b"], pieces=4) == (1, "aab")  # across a failure link
    assert _first_stop("abcabd", ["abd", "bca", "c"], pieces=6) == (2, "c")


def test_stop_strings_agree_with_a_plain_search_on_random_text() -> None:
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 5))]
        pieces = rng.randint(1, 6)
        expected, size, seen = None, max(1, -(-len(text) // pieces)), 0
        for k in range(0, len(text), size):  # the plain search: the first chunk that completes a stop
            seen = k + len(text[k:k + size])
            found = [(text.find(s), i, s) for i, s in enumerate(stops) if 0 <= text.find(s) <= seen - len(s)]
            if found:
                start, _, stop = min(found)
                expected = (start, stop)
                break
        assert _first_stop(text, stops, pieces) == expected, (text, stops, pieces)


def test_a_million_stop_strings_cost_a_step_linear_in_its_new_text() -> None:
    stops = [f"{i:07d}" for i in range(200_000)]  # 1.4M characters: built once per request
    automaton = StopStrings(stops)
    t0 = time.perf_counter()
    state, hit = 0, None
    for k in range(2000):  # 2,000 one-character steps, none completes a stop
        state, hit = automaton.scan(state, "x", k)
        assert hit is None
    assert time.perf_counter() - t0 < 0.5  # a scan per stop string took ~10 ms per step here
    assert automaton.scan(0, "ab0001234", 0)[1] == (2, "0001234")


def test_stop_string_spanning_token_boundaries_is_found_while_streaming(
        family_dirs: dict[str, Path]) -> None:
    tok = Tokenizer.from_dir(family_dirs["qwen2"])
    assert tok is not None
    text = "The miller weighed the grain 😀 and paid in copper coins."
    stops = ["paid in cop", "grain 😀 an", "never"]
    ids = tok.encode(text)
    assert all(len(tok.encode(s, add_special_tokens=False)) > 1 for s in stops[:2])
    detector = StopDetector(tok, [], StopStrings(stops))
    hit = None
    for token in ids:
        hit = detector.add([token])
        if hit is not None:
            break
    assert hit is not None
    index, stop = hit
    assert stop == "grain 😀 an" and detector.text[:index] == "The miller weighed the "


def test_default_model_dir_is_built_once_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIDECAR_HOME", str(tmp_path))
    first = default_model_dir()
    assert first.parent == tmp_path / "models" and first.name.startswith("tiny-qwen2-")
    stamp = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    assert default_model_dir() == first
    assert {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == stamp
    assert [p.name for p in (tmp_path / "models").iterdir()] == [first.name]  # no temp dirs left
    assert read_model_config(first).family == DEFAULT_TINY.family
    other = default_model_dir(TinyModelSpec(family="llama"))
    assert other != first and read_model_config(other).family == "llama"


def test_concurrent_default_builds_agree(tmp_path: Path) -> None:
    spec = TinyModelSpec(num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(default_model_dir(spec, root=tmp_path)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len(set(results)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [results[0].name]
    assert len(list(results[0].iterdir())) == 6


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sidecar make-model")
    make_model_cli.add_arguments(parser)
    return make_model_cli.run(parser.parse_args(argv))


def test_cli_writes_a_model_and_refuses_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "model"
    assert _cli([str(out), "--family", "mistral", "--layers", "2", "--dtype", "bfloat16"]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "parameters" in printed and "bytes" in printed
    assert read_model_config(out).num_layers == 2
    before = (out / "model.safetensors").read_bytes()

    assert _cli([str(out), "--seed", "1"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == before

    assert _cli([str(out), "--seed", "1", "--overwrite"]) == 0
    assert (out / "model.safetensors").read_bytes() != before
    (out / "notes.txt").write_text("mine")
    assert _cli([str(out), "--overwrite"]) == 2  # never deletes files it did not write
    assert (out / "notes.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    assert _cli([str(tmp_path / "empty")]) == 0  # an empty directory is not "existing"
    assert read_model_config(tmp_path / "empty").family == "qwen2"
    assert _cli([str(tmp_path / "bad"), "--heads", "3"]) == 2
    assert "num_kv_heads" in capsys.readouterr().err
