"""Chat templates: a model's own Jinja template, rendered the way transformers renders it.

Where the template comes from (`load_chat_template`): `chat_template.jinja` beside the tokenizer
(what transformers 4.43+ saves), else tokenizer_config.json's `chat_template`, a string or a list of
named templates (the one named "default" is used). None: the model has no chat template.

How it is rendered (`render_chat`): jinja2's ImmutableSandboxedEnvironment (a template is data from a
model directory: it may read the messages but not reach Python objects' internals or mutate
anything), trim_blocks and lstrip_blocks, the loopcontrols extension, a `tojson` filter that keeps
non-ASCII text, `raise_exception(msg)` and `strftime_now(fmt)`, a no-op `{% generation %}` block
(transformers marks assistant spans with it), and as variables: messages, add_generation_prompt,
tools, documents, the special tokens (bos_token, eos_token, pad_token, unk_token) and any extra
keyword (e.g. enable_thinking). The rendered text already holds the template's special tokens, so it
is encoded with add_special_tokens=False (as transformers' apply_chat_template(tokenize=True) does).
jinja2 (a dependency of torch and of the server extra) is imported here only, on first use.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from inference.core import InvalidRequestError

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


def load_chat_template(tokenizer_dir: str | Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The chat template of a tokenizer directory (see the module note), or None."""
    path = Path(tokenizer_dir) / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def special_token_strings(tokenizer_config: dict[str, Any]) -> dict[str, str]:
    """bos_token, eos_token, ... as the template sees them: strings (AddedToken dicts give their content)."""
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = tokenizer_config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


RESERVED_VARIABLES = ("messages", "add_generation_prompt")  # the body's own fields, never kwargs


def check_template_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse template variables that the request sets itself (InvalidRequestError naming the key)."""
    for name in RESERVED_VARIABLES:
        if name in kwargs:
            raise InvalidRequestError(f"chat_template_kwargs.{name}", f"is set by the request itself ({name} "
                                      "is a field of the body): leave it out of chat_template_kwargs")


def render_chat(template: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                special_tokens: dict[str, str] | None = None, **kwargs: Any) -> str:
    """The prompt text of `messages` under `template`. A template that fails (it raised, or it is not
    valid Jinja) is an InvalidRequestError naming "messages" with the template's own message."""
    import jinja2

    check_template_kwargs(kwargs)
    variables = {"tools": None, "documents": None, **(special_tokens or {}), **kwargs}
    try:
        compiled = _compile(template)
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as e:
        raise InvalidRequestError("messages", f"the model's chat template failed: {e}") from e
    except (TypeError, ValueError, LookupError, AttributeError, RecursionError) as e:
        # a template meeting values of a type it does not expect (a chat_template_kwargs value, a message)
        raise InvalidRequestError("messages", f"the model's chat template failed on this chat: "
                                              f"{type(e).__name__}: {e}") from e


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}`: renders its body (transformers uses the tag to
        mark assistant tokens for training masks; a prompt needs only the text)."""

        tags = {"generation"}  # noqa: RUF012 (jinja2's declaration)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)
