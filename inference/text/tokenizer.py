"""Text <-> token ids: a thin wrapper over `tokenizers.Tokenizer`, plus streaming detokenization.

Works with any Hugging Face model directory that has a tokenizer.json (ours from inference.models.tiny or
a real checkpoint's). Without one the engine takes token ids only and returns text=None
(`Tokenizer.from_dir` returns None).

Special-token ids are gathered from generation_config.json, config.json and tokenizer_config.json,
in that order of precedence for eos (all three contribute) and config-first for bos. The model's chat
template travels with the tokenizer (`chat_template`, `apply_chat_template`; rendering in
inference/text/chat_template.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from inference.core import InvalidRequestError
from inference.text.chat_template import load_chat_template, render_chat, special_token_strings

# A UTF-8 character is at most 4 bytes and every token adds at least one byte, so an incomplete
# trailing character spans at most 3 tokens; more held tokens than this means the bytes are invalid.
_MAX_HELD_TOKENS = 4
# Tokens of context decoded before the new ones (SentencePiece-style decoders drop a leading space
# of the first token in a decode call, so deltas must be computed inside a window).
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class Tokenizer:
    """Encode/decode with the special-token conventions of a model directory.

    Invariants: `eos_token_ids` is a tuple without duplicates (possibly empty); `encode` returns
    plain ints; decoding ids outside the vocabulary skips them (as `tokenizers` does), which is
    what the padded rows of a model's embedding produce.
    """

    def __init__(self, tok: HFTokenizer, *, eos_token_ids: Sequence[int] = (),
                 bos_token_id: int | None = None, add_bos_token: bool | None = None,
                 chat_template: str | None = None, special_tokens: dict[str, str] | None = None) -> None:
        self._tok = tok
        self.chat_template = chat_template  # None: the model has none
        self.special_tokens = dict(special_tokens or {})  # bos_token, eos_token, ... as strings
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.bos_token_id = bos_token_id
        # None: leave it to tokenizer.json's post-processor (e.g. Llama 3's TemplateProcessing).
        self.add_bos_token = add_bos_token

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer | None:
        """Load `model_dir/tokenizer.json` and the special tokens of its config files; None if absent."""
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            return None
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise InvalidRequestError("tokenizer", f"cannot load {path}: {e}") from e
        tok_cfg = _read_json(d / "tokenizer_config.json")
        cfg = _read_json(d / "config.json")
        gen_cfg = _read_json(d / "generation_config.json")

        eos: list[int] = [*_ids(gen_cfg.get("eos_token_id")), *_ids(cfg.get("eos_token_id"))]
        eos += _ids(_token_id(tok, tok_cfg.get("eos_token")))
        bos = cfg.get("bos_token_id")
        if bos is None:
            bos = _token_id(tok, tok_cfg.get("bos_token"))
        if bos is None:
            bos = gen_cfg.get("bos_token_id")
        add_bos = tok_cfg.get("add_bos_token")
        return cls(tok, eos_token_ids=eos, bos_token_id=bos,
                   add_bos_token=None if add_bos is None else bool(add_bos),
                   chat_template=load_chat_template(d, tok_cfg), special_tokens=special_token_strings(tok_cfg))

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (a model's vocab_size may be larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def hf_tokenizer(self) -> HFTokenizer:
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, a BOS as tokenizer_config's add_bos_token says."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if not add_special_tokens or self.add_bos_token is None or self.bos_token_id is None:
            return ids
        starts_with_bos = bool(ids) and ids[0] == self.bos_token_id
        if self.add_bos_token and not starts_with_bos:
            return [self.bos_token_id, *ids]
        if not self.add_bos_token and starts_with_bos:
            # Only drop a BOS the post-processor added, never one that the text itself spelled out.
            plain = self._tok.encode(text, add_special_tokens=False).ids
            if ids[1:] == plain:
                return plain
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The prompt text of a chat under the model's own template (encode it with
        add_special_tokens=False: the template wrote them). InvalidRequestError naming "messages"
        when the model has no template or the template refuses the chat."""
        if self.chat_template is None:
            raise InvalidRequestError("messages", "this model has no chat template (tokenizer_config.json's "
                                                  "chat_template or chat_template.jinja): send a plain prompt")
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=self.special_tokens, **kwargs)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise InvalidRequestError("tokenizer", f"{path} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]


def _token_id(tok: HFTokenizer, token: Any) -> int | None:
    """Id of a special token as tokenizer_config writes it: a string or an AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    return tok.token_to_id(token)


class IncrementalDetokenizer:
    """Streams one sequence's text: `add(new_ids)` returns only the newly decoded text.

    Decodes a small window (prefix/read offsets, as vLLM does), so the cost per token does not
    grow with the sequence. A delta never ends inside a multi-byte UTF-8 character: while the
    window's text ends with U+FFFD the tokens are held back until they complete the character.
    Ids are taken one at a time, so a batch of ids (speculative decoding) behaves like single steps.
    Invariants: `text` is the concatenation of every delta returned so far (plus `flush()`); for a
    valid UTF-8 output it equals decode(all generated ids) and no delta contains U+FFFD. Invalid
    bytes (a random model can emit them) come out as U+FFFD once more than _MAX_HELD_TOKENS tokens
    are held, and then may differ from a full decode in the replacement characters only.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Prompt tokens are context only: their text is never emitted.
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)  # text of ids[prefix_offset:read_offset]
        self.text = ""

    def add(self, new_ids: Iterable[int]) -> str:
        """Append generated ids; return the text they complete (possibly "")."""
        delta = "".join(self._add_one(int(i)) for i in new_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (incomplete bytes become U+FFFD); call when the sequence ends."""
        full_text = self._decode(self._ids[self._prefix_offset:])
        delta = full_text[len(self._prefix_text):]
        self._advance(reset=True)
        self.text += delta
        return delta

    def _add_one(self, token_id: int) -> str:
        self._ids.append(token_id)
        full_text = self._decode(self._ids[self._prefix_offset:])
        incomplete = full_text.endswith(_REPLACEMENT)
        if incomplete and len(self._ids) - self._read_offset <= _MAX_HELD_TOKENS:
            return ""
        if len(full_text) <= len(self._prefix_text) and not incomplete:
            return ""  # nothing visible yet (a skipped special token): keep the window as it is
        delta = full_text[len(self._prefix_text):]
        # After emitting invalid bytes as U+FFFD, restart the window so they never merge with later bytes.
        self._advance(reset=incomplete)
        return delta

    def _advance(self, reset: bool) -> None:
        n = len(self._ids)
        self._prefix_offset = n if reset else max(self._read_offset, n - _CONTEXT_TOKENS)
        self._read_offset = n
        # Keep only the tokens the window can still look at, so memory stays bounded too.
        del self._ids[:self._prefix_offset]
        self._read_offset -= self._prefix_offset
        self._prefix_offset = 0
        self._prefix_text = self._decode(self._ids)
        assert 0 <= self._read_offset == len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, self._skip) if ids else ""
