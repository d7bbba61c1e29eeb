"""`sidecar make-model OUT_DIR`: write a tiny random model directory (the embedded default model).

With the default settings OUT_DIR holds the very model `sidecar launch` and `sidecar demo` serve when
given no --model (same seed, same bytes): a trainer loads it with transformers'
AutoModelForCausalLM.from_pretrained(OUT_DIR) and `sidecar launch --model OUT_DIR` serves the same
weights. Its weights are random, so its text is gibberish; its tokenizer and chat template are real.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from inference.core import InvalidRequestError
from inference.models.tiny import DEFAULT_TINY, FAMILIES, DirectoryNotEmptyError, make_tiny_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DEFAULT_TINY
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (must be empty or absent)")
    parser.add_argument("--family", choices=FAMILIES, default=d.family, help="model architecture")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the random weights: same seed, same bytes")
    parser.add_argument("--hidden-size", type=int, default=d.hidden_size, help="hidden size")
    parser.add_argument("--layers", type=int, default=d.num_layers, help="decoder layers")
    parser.add_argument("--heads", type=int, default=d.num_heads, help="attention heads")
    parser.add_argument("--kv-heads", type=int, default=d.num_kv_heads, help="key/value heads (divides --heads)")
    parser.add_argument("--intermediate-size", type=int, default=d.intermediate_size, help="MLP width")
    parser.add_argument("--head-dim", type=int, default=None, help="default: hidden size / heads")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="default: the tokenizer's size; larger pads the embedding")
    parser.add_argument("--max-position-embeddings", type=int, default=d.max_position_embeddings,
                        help="the longest context the config declares")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=d.dtype,
                        help="dtype of the weights")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing model directory written by this command")


def run(args: argparse.Namespace) -> int:
    try:
        path = make_tiny_model(
            args.out_dir, args.family, overwrite=args.overwrite, seed=args.seed,
            hidden_size=args.hidden_size, num_layers=args.layers, num_heads=args.heads,
            num_kv_heads=args.kv_heads, intermediate_size=args.intermediate_size, head_dim=args.head_dim,
            vocab_size=args.vocab_size, max_position_embeddings=args.max_position_embeddings,
            dtype=args.dtype)
    except DirectoryNotEmptyError as e:
        print(f"sidecar make-model: error: {e.path} is not empty; pass --overwrite to replace it (only a "
              "directory this command wrote can be replaced)", file=sys.stderr)
        return 2
    except (FileExistsError, InvalidRequestError) as e:
        print(f"sidecar make-model: error: {e}", file=sys.stderr)
        return 2
    print(path)
    print(summary(path, args.family, args.dtype))
    return 0


def summary(path: Path, family: str, dtype: str) -> str:
    """One line: family, parameter count and bytes of model.safetensors."""
    from safetensors import safe_open

    weights = path / "model.safetensors"
    params = 0
    with safe_open(str(weights), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            shape = f.get_slice(name).get_shape()
            n = 1
            for dim in shape:
                n *= dim
            params += n
    size = weights.stat().st_size
    return f"{family} {dtype}: {params:,} parameters, {size:,} bytes in model.safetensors"
