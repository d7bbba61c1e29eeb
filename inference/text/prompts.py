"""Prompt intake: the checks a prompt passes before any work, and tokenization that lets other threads run.

Both the in-process engine (inference/engine/llm.py) and the sidecar's HTTP layer (sidecar/api/intake.py)
check prompts here, so a prompt is refused for the same reasons, with the same message, either way:

- A text prompt longer than `max_chars` characters is refused before it is tokenized (tokenizing
  costs about a second per MB of text, and its token list several times the text's memory).
- A text prompt must be valid Unicode: JSON can carry a lone surrogate ("\\ud800"), which Python
  keeps in a str but no tokenizer can encode (tokenizers raised TypeError, a 500).
- Token ids are ints inside the vocabulary.

`GilFreeTokenizer` wraps `inference.text.tokenizer.Tokenizer` so that `encode` runs inside
`tokenizers.encode_batch`, which releases the GIL (plain `encode` holds it for the whole text: a
1 MB prompt froze every other thread of the process for ~0.7 s). The special-token rule stays
`Tokenizer.encode`'s own; only the call into the Rust tokenizer changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from inference.core import InvalidRequestError
from inference.text.tokenizer import Tokenizer


def check_text(text: str, field: str = "prompt", max_chars: int | None = None) -> None:
    """Refuse a text prompt that is too long (before any tokenization) or not valid Unicode."""
    if max_chars is not None and len(text) > max_chars:
        raise InvalidRequestError(field, f"has {len(text)} characters; at most {max_chars} are accepted "
                                         "(the sidecar's --max-prompt-chars); send shorter prompts or token ids")
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(field, f"is not valid Unicode: a lone surrogate {text[e.start]!r} at character "
                                         f"{e.start} (JSON \\ud800-\\udfff escapes must come in pairs)") from None


def check_token_ids(ids: Sequence[Any], vocab_size: int, field: str = "prompt") -> None:
    """Every id an int in [0, vocab_size). The common case runs at C speed (min/max), so a long
    prompt costs milliseconds; the slow scan runs only to name the first bad id."""
    if all(type(t) is int for t in ids) and (not ids or (min(ids) >= 0 and max(ids) < vocab_size)):
        return
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise InvalidRequestError(field, f"token {i} = {t!r} is outside the vocabulary [0, {vocab_size})")


class _ReleasingEncoder:
    """The part of `tokenizers.Tokenizer` that `Tokenizer.encode` calls, through encode_batch."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]


class GilFreeTokenizer:
    """`encode(text)` with `Tokenizer.encode`'s result, run without holding the GIL."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._impl = Tokenizer(_ReleasingEncoder(tokenizer.hf_tokenizer),  # type: ignore[arg-type]
                               eos_token_ids=tokenizer.eos_token_ids, bos_token_id=tokenizer.bos_token_id,
                               add_bos_token=tokenizer.add_bos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._impl.encode(text, add_special_tokens)
