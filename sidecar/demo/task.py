"""What `sidecar demo` trains: the model directory, the prompts and the reward, all on token ids.

Models: "tiny" (the embedded default), "qwen2-0.5b" (Qwen2-0.5B's exact shape with seeded random bf16
weights, written once into the model cache as qwen2-0.5b-random-<hash>; nothing is downloaded) or a path
to an HF model directory. torch is imported inside the functions that need it, so that the demo's
argument parsing (`sidecar demo --help`) stays fast.

Rewards are the fraction of a completion's tokens that fall in a target set of ids:
- "digits": the tokens made of ASCII digits in the model's tokenizer.json (needs a tokenizer that
  covers the sampled ids: the tiny model's default);
- "ids": every id divisible by TARGET_EVERY (1/16 of any vocabulary), so no tokenizer is needed and
  a random 152k-vocabulary model starts near 1/16 and climbs as REINFORCE moves mass onto them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from inference.core import InvalidRequestError
from inference.models.hf_config import model_config_from_hf
from inference.models.tiny import TinyModelSpec, default_model_dir

MODELS = ("tiny", "qwen2-0.5b")
REWARDS = ("auto", "digits", "ids")
TARGET_EVERY = 16
FIRST_PROMPT_ID = 4  # ids 0-3 are the special tokens of the tiny tokenizer

QWEN2_05B_CACHE_NAME = "qwen2-0.5b-random"  # its directory in the model cache: not a tiny model
QWEN2_05B = TinyModelSpec(family="qwen2", hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                          head_dim=64, intermediate_size=4864, vocab_size=151936, dtype="bfloat16",
                          tie_word_embeddings=True, rope_theta=1_000_000.0, max_position_embeddings=4096)


@dataclass(frozen=True)
class DemoModel:
    """A resolved model: its directory and the config fields the demo needs."""

    name: str
    path: Path
    dtype: str
    vocab_size: int
    kv_bytes_per_token: int


@dataclass(frozen=True)
class TokenReward:
    """reward(token_ids) = the fraction of the ids in `targets`; `kind` is "digits" or "ids"."""

    kind: str
    targets: frozenset[int]

    def __call__(self, token_ids: list[int]) -> float:
        return sum(t in self.targets for t in token_ids) / max(1, len(token_ids))


@dataclass(frozen=True)
class DemoSetup:
    """Everything resolved from `sidecar demo`'s arguments before the sidecar starts."""

    model: DemoModel
    reward: TokenReward
    device: str
    backend: str
    lr: float
    quantization: str = "none"  # the sidecar's --quantization (docs/fp8.md)


def resolve_model(name: str) -> DemoModel:
    """Build (once, cached) or check the model directory named by --model."""
    from checksum.dtypes import DTYPES

    if name == "tiny":
        path = default_model_dir()
    elif name == "qwen2-0.5b":
        path = default_model_dir(QWEN2_05B, name=QWEN2_05B_CACHE_NAME)
    else:
        path = Path(name).expanduser().absolute()
        if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
            raise InvalidRequestError("model", f"{name!r} is neither one of {list(MODELS)} nor a directory "
                                      "holding config.json and model.safetensors")
    raw = json.loads((path / "config.json").read_text())
    try:
        cfg = model_config_from_hf(raw)
    except KeyError as e:
        raise InvalidRequestError("model", f"{path / 'config.json'} lacks the field {e}") from None
    # The toy policy's rule (a checkpoint without a dtype is float32), so both ends hold the same bytes.
    dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "float32")
    if dtype not in DTYPES:
        raise InvalidRequestError("model", f"{path / 'config.json'}: unknown dtype {dtype!r}")
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * DTYPES[dtype].itemsize
    return DemoModel(name, path, dtype, cfg.vocab_size, per_token)


def make_reward(kind: str, model: DemoModel) -> TokenReward:
    """kind "auto" is "digits" on the tiny model and "ids" on every other."""
    if kind == "auto":
        kind = "digits" if model.name == "tiny" else "ids"
    if kind == "ids":
        return TokenReward("ids", frozenset(range(0, model.vocab_size, TARGET_EVERY)))
    if kind != "digits":
        raise InvalidRequestError("reward", f"unknown reward {kind!r}; choose one of {list(REWARDS)}")
    return TokenReward("digits", frozenset(_digit_token_ids(model.path)))


def make_prompts(reward: TokenReward, model: DemoModel, batch: int, length: int, seed: int) -> list[list[int]]:
    """Random prompt ids. With the digits reward they come from the tokenizer's low ids (as the tiny
    demo always drew them); otherwise from the whole vocabulary past the special ids."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    if reward.kind == "digits":
        low, high = len(reward.targets) + 20, min(500, model.vocab_size)
    else:
        low, high = FIRST_PROMPT_ID, model.vocab_size
    return torch.randint(low, high, (batch, length), generator=gen).tolist()


def kv_cache_bytes(model: DemoModel, device: str, sequences: int, tokens_per_sequence: int) -> int:
    """Room for every rollout at once (one spare 16-token block per sequence, then doubled), never less
    than the tiny demo's fixed sizes."""
    floor = 4_000_000 if device == "cpu" else 64 * 2**20
    blocks = -(-tokens_per_sequence // 16) + 1
    return max(floor, 2 * sequences * blocks * 16 * model.kv_bytes_per_token)


def _digit_token_ids(model_dir: Path) -> set[int]:
    """Ids of the tokens made of ASCII digits only."""
    tok_path = model_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise InvalidRequestError("reward", f"the digits reward needs {tok_path}; use --reward ids")
    vocab = json.loads(tok_path.read_text())["model"]["vocab"]
    ids = {i for tok, i in vocab.items() if tok and all("0" <= ch <= "9" for ch in tok)}
    if not ids:
        raise InvalidRequestError("reward", f"{tok_path} has no digit tokens; use --reward ids")
    return ids
