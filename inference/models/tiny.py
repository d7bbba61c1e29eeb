"""The embedded default model: a tiny random Hugging Face checkpoint written on the spot.

Nothing is downloaded and transformers is not imported: config.json, generation_config.json and
model.safetensors are written by hand in the layout transformers writes (4.x fields and 5.x's
`rope_parameters`/`dtype` side by side), and the tokenizer is a byte-level BPE trained with
`tokenizers` on the small English corpus below (see `train_tokenizer`).

Invariants:
- Same settings (TinyModelSpec) -> byte-identical files. Weights come from one seeded
  torch.Generator drawn in a fixed tensor order; the BPE trainer is deterministic.
- A model directory appears whole or not at all: files are written to a temporary sibling
  directory which is then renamed into place.
- Token ids: 0 <|endoftext|> (eos, pad), 1 <|startoftext|> (bos, prepended where the family's class
  says tokenizer_adds_bos, as real Llama checkpoints do), 2 <|im_start|>, 3 <|im_end|> (a second eos
  in config.json and generation_config.json). Byte-level: every string encodes without unknown tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors, trainers
from tokenizers.models import BPE

from inference import envs
from inference.core import InvalidRequestError
from inference.models import family_names, get_family
from inference.models.hf_config import model_config_from_hf
from inference.models.naming import expected_hf_tensors

if TYPE_CHECKING:
    import torch

FAMILIES = family_names()  # the shipped ones; a family registered later can be written too
# The dtypes a tiny model is written in. torch itself is imported only where weights are drawn, so that
# `sidecar make-model --help` and the demo's argument parsing stay fast (scripts/tools/check_help_speed.py).
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")

SPECIAL_TOKENS = ("<|endoftext|>", "<|startoftext|>", "<|im_start|>", "<|im_end|>")
EOS_ID, BOS_ID, IM_START_ID, IM_END_ID = 0, 1, 2, 3
TOKENIZER_VOCAB_SIZE = 512
# Bumped whenever the bytes written for the same spec change, so cached default dirs are rebuilt.
_FORMAT_VERSION = 1
_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
          "tokenizer_config.json", "special_tokens_map.json")
_CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Splits words, single digits, punctuation runs and whitespace (the regex of Qwen2's tokenizer.json).
_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CORPUS = """\
The river ran slowly past the old mill, and the miller's daughter watched the water turn the wheel.
Every morning she counted the sacks of grain: one, two, three, four, five. Her father said that
numbers were the only honest things in the valley, because they never pretended to be more than they were.

In the spring the farmers brought their wheat, their barley and their stories. Some of the stories
were true. Most of them were better than true. The miller listened, weighed the grain, wrote the
weight in a small book and paid in copper coins. "A fair price for a fair day," he would say.

Learning is a kind of patience. A student reads a sentence, then another, and slowly the words begin
to carry meaning from one mind to the next. Models learn the same way, one token at a time, one step
after another, until the pattern of the language settles into their weights.

The train left the station at 7:45 and arrived at 10:30; it was late again. Passengers asked
questions -- why? how long? who is responsible? -- and nobody answered them. Still, the coffee was
hot, the seats were clean, and the view of the mountains (covered with snow in March) was worth it.

Café, naïve, déjà vu, Zürich, São Paulo: words travel, and they keep their accents when they do.
"""
_EXTRA = "0123456789 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14 42% $5 #1 a+b=c x*y<z [a] {b} (c) @ ^ ~ | \\ /"


class DirectoryNotEmptyError(FileExistsError):
    """The target of a model write holds files and overwrite was not asked for (`path` names it; a CLI
    words the remedy with its own flag)."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"{path} is not empty; pass overwrite=True to replace it")
        self.path = path


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines a tiny model directory's bytes.

    vocab_size None: the tokenizer's size; larger values pad the embedding like real checkpoints.
    head_dim None: hidden_size // num_heads. tie_word_embeddings None: the family's default.
    rope_scaling: None, or a llama3 dict {"rope_type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"} (a dict, so it is left out of hash()).
    """

    family: str = "qwen2"
    seed: int = 0
    vocab_size: int | None = None
    hidden_size: int = 128
    num_layers: int = 3
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 256
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    dtype: str = "float32"
    tie_word_embeddings: bool | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    rms_norm_eps: float = 1e-6

    def validate(self) -> None:
        def bad(name: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"tiny_model.{name}", msg)

        if self.family not in family_names():
            raise bad("family", f"unknown family {self.family!r}; supported: {list(family_names())}")
        if self.dtype not in WEIGHT_DTYPES:
            raise bad("dtype", f"unsupported dtype {self.dtype!r}; supported: {list(WEIGHT_DTYPES)}")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                     "max_position_embeddings"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise bad(name, f"must be a positive integer, got {getattr(self, name)!r}")
        if self.vocab_size is not None and self.vocab_size < TOKENIZER_VOCAB_SIZE:
            raise bad("vocab_size", f"must be >= the tokenizer's {TOKENIZER_VOCAB_SIZE} tokens")
        if self.num_heads % self.num_kv_heads:
            raise bad("num_kv_heads", f"{self.num_kv_heads} does not divide num_heads={self.num_heads}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise bad("hidden_size", f"{self.hidden_size} is not divisible by num_heads={self.num_heads}")
        if self.resolved_head_dim % 2:
            raise bad("head_dim", f"rotary embeddings need an even head_dim, got {self.resolved_head_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", "llama3")
            if kind != "llama3" or "factor" not in self.rope_scaling:
                raise bad("rope_scaling", f"only llama3 scaling with a factor is supported, got {kind!r}")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def resolved_vocab_size(self) -> int:
        return self.vocab_size or TOKENIZER_VOCAB_SIZE

    @property
    def tied(self) -> bool:
        if self.tie_word_embeddings is None:
            return get_family(self.family).tie_word_embeddings_default
        return self.tie_word_embeddings

    def digest(self) -> str:
        """A short hash of the settings, the corpus and the format version (names the cached dir)."""
        blob = json.dumps([_FORMAT_VERSION, _CORPUS, _EXTRA, _SPLIT_REGEX, dataclasses.asdict(self)],
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


DEFAULT_TINY = TinyModelSpec()


def train_tokenizer(*, add_bos: bool = False) -> Tokenizer:
    """Train the deterministic byte-level BPE (TOKENIZER_VOCAB_SIZE tokens) on the embedded corpus.

    add_bos: prepend <|startoftext|> when encoding with special tokens (a TemplateProcessing
    post-processor, as Llama 3's tokenizer.json does).
    """
    tok = Tokenizer(BPE())
    # Qwen2's pipeline without its NFC normalizer, so that every string round-trips exactly.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE, min_frequency=1, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS, _EXTRA], trainer=trainer)
    assert tok.get_vocab_size() == TOKENIZER_VOCAB_SIZE, tok.get_vocab_size()
    byte_level = processors.ByteLevel(trim_offsets=False)
    if add_bos:
        bos = SPECIAL_TOKENS[BOS_ID]
        template = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, BOS_ID)])
        tok.post_processor = processors.Sequence([byte_level, template])
    else:
        tok.post_processor = byte_level
    return tok


def make_tiny_model(
    out_dir: str | Path, family: str = "qwen2", *, seed: int = 0, vocab_size: int | None = None,
    hidden_size: int = DEFAULT_TINY.hidden_size, num_layers: int = DEFAULT_TINY.num_layers,
    num_heads: int = DEFAULT_TINY.num_heads, num_kv_heads: int = DEFAULT_TINY.num_kv_heads,
    intermediate_size: int = DEFAULT_TINY.intermediate_size, head_dim: int | None = None,
    max_position_embeddings: int = DEFAULT_TINY.max_position_embeddings, dtype: str = "float32",
    tie_word_embeddings: bool | None = None, rope_theta: float = DEFAULT_TINY.rope_theta,
    rope_scaling: dict[str, Any] | None = None, overwrite: bool = False,
) -> Path:
    """Write a complete tiny HF model directory for `family`; returns its absolute path.

    Settings mean what TinyModelSpec says. An existing non-empty out_dir is an error
    (FileExistsError) unless overwrite=True, and even then only if it holds nothing but the files
    this function writes. Bad settings raise InvalidRequestError naming the field.
    """
    spec = TinyModelSpec(
        family=family, seed=seed, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
        head_dim=head_dim, max_position_embeddings=max_position_embeddings, dtype=dtype,
        tie_word_embeddings=tie_word_embeddings, rope_theta=rope_theta, rope_scaling=rope_scaling)
    return write_model_dir(spec, out_dir, overwrite=overwrite)


def first_layers(src: str | Path, dst: str | Path, layers: int) -> Path:
    """A draft made of a model directory's first `layers` decoder layers, with its embedding, final norm
    and head (so it agrees with the source often): a copy of `src` at `dst` with the config and the
    weights cut. Returns `dst`."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (dst / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(src / "model.safetensors"))
    keep = {n: t for n, t in state.items() if not n.startswith("model.layers.") or int(n.split(".")[2]) < layers}
    save_file(keep, str(dst / "model.safetensors"))
    return dst


def write_model_dir(spec: TinyModelSpec, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """Write `spec` into out_dir atomically (temporary sibling directory, then rename)."""
    spec.validate()
    out = Path(out_dir).expanduser().absolute()
    existing = _check_target(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_files(spec, tmp)
        if existing:
            shutil.rmtree(out)
        os.replace(tmp, out)  # replaces an empty directory; a non-empty one was removed above
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _check_target(out: Path, overwrite: bool) -> bool:
    """Return whether out holds a previous model to replace; raise if it must not be touched."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return False
    if not overwrite:
        raise DirectoryNotEmptyError(out)
    foreign = sorted(p.name for p in out.iterdir() if p.name not in _FILES)
    if foreign:
        raise FileExistsError(f"refusing to overwrite {out}: it holds files this tool did not write "
                              f"({', '.join(foreign[:5])})")
    return True


def _write_files(spec: TinyModelSpec, d: Path) -> None:
    add_bos = get_family(spec.family).tokenizer_adds_bos
    texts = {
        "config.json": _dump(hf_config(spec)),
        "generation_config.json": _dump(
            {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID], "pad_token_id": EOS_ID}),
        "tokenizer.json": train_tokenizer(add_bos=add_bos).to_str(pretty=True),
        "tokenizer_config.json": _dump(_tokenizer_config(spec, add_bos)),
        "special_tokens_map.json": _dump(
            {**_special_token_names(), "additional_special_tokens": list(SPECIAL_TOKENS[IM_START_ID:])}),
    }
    for name, text in texts.items():
        (d / name).write_text(text, encoding="utf-8")
    from safetensors.torch import save_file

    save_file(random_weights(spec), str(d / "model.safetensors"), metadata={"format": "pt"})
    assert sorted(p.name for p in d.iterdir()) == sorted(_FILES)
    # mkdtemp makes the directory private (0700) and safetensors writes 0600; models are shared.
    d.chmod(0o755)
    for name in _FILES:
        (d / name).chmod(0o644)


def _dump(obj: dict[str, Any]) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _special_token_names() -> dict[str, str]:
    return {"bos_token": SPECIAL_TOKENS[BOS_ID], "eos_token": SPECIAL_TOKENS[EOS_ID],
            "pad_token": SPECIAL_TOKENS[EOS_ID]}


def _tokenizer_config(spec: TinyModelSpec, add_bos: bool) -> dict[str, Any]:
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    return {
        "add_bos_token": add_bos, "add_eos_token": False, "added_tokens_decoder": added,
        "additional_special_tokens": list(SPECIAL_TOKENS[IM_START_ID:]), "chat_template": _CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False, "model_max_length": spec.max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": None, **_special_token_names(),
    }


def hf_config(spec: TinyModelSpec) -> dict[str, Any]:
    """config.json as transformers writes it for the family, with 4.x and 5.x rope/dtype fields."""
    family = get_family(spec.family)
    rope_parameters: dict[str, Any] = {"rope_theta": spec.rope_theta, "rope_type": "default"}
    if spec.rope_scaling is not None:
        rope_parameters = {**spec.rope_scaling, "rope_type": "llama3", "rope_theta": spec.rope_theta}
    return {
        "architectures": [family.architectures[0]], "model_type": family.model_type,
        "vocab_size": spec.resolved_vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.resolved_head_dim, "hidden_act": "silu", "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": spec.max_position_embeddings, "initializer_range": 0.02,
        "attention_dropout": 0.0, "use_cache": True, "tie_word_embeddings": spec.tied,
        # Both eos ids here too (as Llama 3.1 does), so that engines reading only config.json
        # stop where HF's generate (generation_config.json) stops.
        "bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID], "pad_token_id": EOS_ID,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None if spec.rope_scaling is None else dict(rope_parameters),
        "rope_parameters": rope_parameters, "torch_dtype": spec.dtype, "dtype": spec.dtype,
        **family.hf_config_fields(spec.num_layers),
    }


def weight_shapes(spec: TinyModelSpec) -> dict[str, tuple[int, ...]]:
    """HF tensor names -> shapes, in the fixed order the random weights are drawn: what the engine
    expects of the config.json this spec writes (the family's layout, inference/models/naming.py)."""
    return expected_hf_tensors(model_config_from_hf(hf_config(spec)))


def random_weights(spec: TinyModelSpec) -> dict[str, torch.Tensor]:
    """Seeded random weights in HF names, cast to spec.dtype.

    Norms are 1 + N(0, 0.05^2), biases N(0, 0.02^2), the embedding N(0, 0.1^2), and every other
    matrix N(0, 1/fan_in) (0.02-0.09 at these sizes). The fan-in scale keeps the signal alive
    through the layers, so the model's output depends on its context: with a flat 0.02 the
    random model collapses to repeating one token under greedy decoding, which would hide
    position and cache bugs in engine-vs-reference tests.
    """
    import torch

    from checksum.dtypes import dtype_from_name

    gen = torch.Generator().manual_seed(spec.seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(spec).items():
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            x = 1.0 + 0.05 * x
        elif name.endswith(".bias"):
            x = 0.02 * x
        elif name == "model.embed_tokens.weight":
            x = 0.1 * x
        else:
            x = x / math.sqrt(shape[1])
        out[name] = x.to(dtype_from_name(spec.dtype)).contiguous()
    return out


def cache_root() -> Path:
    """$SIDECAR_HOME/models when set, else ~/.cache/sidecar."""
    home = envs.HOME.get()
    return Path(home).expanduser() / "models" if home else Path.home() / ".cache" / "sidecar"


def default_model_dir(spec: TinyModelSpec = DEFAULT_TINY, root: str | Path | None = None,
                      name: str | None = None) -> Path:
    """The cached directory of `spec`, `<name>-<settings hash>` (name default: tiny-<family>), built on
    first use. A model that is not tiny passes its own name, so the cache never calls it tiny.

    Safe under concurrency: each builder writes its own temporary directory and renames it into
    place; a loser of the race discards its copy and uses the winner's (same bytes anyway).
    """
    spec.validate()
    base = Path(root).expanduser() if root is not None else cache_root()
    final = base / f"{name or 'tiny-' + spec.family}-{spec.digest()}"
    if final.is_dir():
        return final
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=base))
    try:
        _write_files(spec, tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # not a lost race: a real failure
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
