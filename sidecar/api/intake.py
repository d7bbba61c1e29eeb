"""What a generation call passes in the sidecar process before the driver queues it (docs/limits.md).

Order, cheapest first, so that a call that will be refused costs next to nothing: the number of
sequences it asks for (prompts x n, --max-request-sequences), each text prompt's length in characters
(--max-prompt-chars) and Unicode validity, then tokenization, then each prompt's token ids and its
prompt + max_tokens against max_model_len (inference/core.py's policy, the ranks apply it again).

Why tokenize here: a rank tokenized inside its step, so one long prompt stalled every other request
for as long as it took, and a tokenization longer than --step-timeout-s had the driver declare the rank
hung (503 for good). Here it runs in a worker thread (`encode_group`) with the GIL released
(inference/text/prompts.py), so neither the event loop, nor the driver, nor any rank step waits on it; the
ranks receive token ids (commands.TokenizedPrompt) and only check them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inference.core import InvalidRequestError, SamplingParams
from inference.text.prompts import GilFreeTokenizer, check_text, check_token_ids
from sidecar.api.common import ApiError
from sidecar.api.text_pool import TextPool, default_workers
from sidecar.ranks.commands import RankPlan, TokenizedPrompt


@dataclass(frozen=True)
class Intake:
    """The checks and the tokenizer of one sidecar; `tokenizer` None: token-id prompts only."""

    tokenizer: GilFreeTokenizer | None
    vocab_size: int
    max_model_len: int
    max_prompt_chars: int
    max_request_sequences: int
    max_stops: int = 256
    max_stop_chars: int = 16384
    max_response_tokens: int = 1 << 27
    max_chat_messages: int = 4096
    pool: TextPool | None = None  # the tokenizer threads (None: asyncio's default executor)
    routing_row_bytes: int = 0  # one token's routing (RankPlan.routing_row_bytes); 0: a dense model

    async def run_text(self, size: int, fn: Any, *args: Any) -> Any:
        """fn(*args) on a tokenizer thread; `size` (characters or token ids) orders the queue."""
        if self.pool is None:
            return await asyncio.to_thread(fn, *args)
        return await self.pool.run(size, fn, *args)

    def check_params(self, params: SamplingParams) -> None:
        """One prompt's sampling params against the per-request work they cause on every step: the number
        of stop strings and stop token ids and the stop strings' characters (InvalidRequestError naming
        the field; the ranks build one automaton from them, linear in their characters)."""
        for name in ("stop", "stop_token_ids"):
            count = len(getattr(params, name))
            if count > self.max_stops:
                raise InvalidRequestError(f"sampling_params.{name}", f"has {count} entries; at most "
                                          f"{self.max_stops} are accepted (the sidecar's --max-stops)")
        chars = sum(len(s) for s in params.stop)
        if chars > self.max_stop_chars:
            raise InvalidRequestError("sampling_params.stop", f"has {chars} characters; at most "
                                      f"{self.max_stop_chars} are accepted (the sidecar's --max-stop-chars)")
        self.check_response([params], "sampling_params.max_tokens")
        if params.return_routing and not self.routing_row_bytes:
            raise InvalidRequestError("sampling_params.return_routing", "the served model is dense: it has no "
                                      "experts to route (return_routing needs an MoE model: qwen3_moe, mixtral)")

    def check_response(self, params: Sequence[SamplingParams], name: str,
                       prompt_lens: Sequence[int] | None = None) -> None:
        """What a call may ask back: the sum of n x max_tokens x (1 + logprobs) over its prompts, plus with
        return_routing (once `prompt_lens` are known) n x (prompt + max_tokens) x the routing row's size in
        8-byte words (InvalidRequestError naming `name`), refused before any work: a 105-byte request
        could ask for a 70 MB answer."""
        total = sum(p.n * p.max_tokens * (1 + p.logprobs) for p in params)
        if prompt_lens is not None:
            words = -(-self.routing_row_bytes // 8)
            total += sum(p.n * (n + p.max_tokens) * words for p, n in zip(params, prompt_lens) if p.return_routing)
        if total > self.max_response_tokens:
            raise InvalidRequestError(name, f"asks back up to {total} tokens and logprobs (n x max_tokens x "
                                      f"(1 + logprobs), summed over the prompts); one call may ask for at most "
                                      f"{self.max_response_tokens} (the sidecar's --max-response-tokens): lower "
                                      "them or split the call")

    def check_sequences(self, params: Sequence[SamplingParams]) -> None:
        """Refuse a call asking for more sequences, or a larger answer, than one call may (400 naming the
        prompts, or the sampling params)."""
        total = sum(int(p.n) for p in params)
        if total > self.max_request_sequences:
            raise ApiError(400, "InvalidRequestError", f"{len(params)} prompt(s) with their n ask for {total} "
                           f"sequences; one call may ask for at most {self.max_request_sequences} (the sidecar's "
                           "--max-request-sequences): split it into several calls", "prompt")
        try:
            self.check_response(params, "sampling_params")
        except InvalidRequestError as e:
            raise ApiError(400, type(e).__name__, e.message, e.field) from None

    def encode(self, prompts: Sequence[Any], params: Sequence[SamplingParams]) -> list[TokenizedPrompt]:
        """Every prompt checked and tokenized, or ApiError 400 naming the first bad one (`index`).
        Runs in a worker thread: it may take a second per MB of text."""
        for i, prompt in enumerate(prompts):  # lengths first: refuse before tokenizing anything
            if isinstance(prompt, str):
                _at(i, check_text, prompt, "prompt", self.max_prompt_chars)
                if self.tokenizer is None:
                    raise _bad(i, InvalidRequestError("prompt", "this model has no tokenizer.json: send token ids"))
        out = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            text = prompt if isinstance(prompt, str) else None
            ids = self.tokenizer.encode(prompt) if text is not None and self.tokenizer is not None else list(prompt)
            _at(i, check_token_ids, ids, self.vocab_size)
            _at(i, sp.check_limits, self.vocab_size, self.max_model_len, len(ids))
            out.append(TokenizedPrompt(text, ids))
        if any(p.return_routing for p in params):
            try:
                self.check_response(params, "sampling_params.return_routing", [len(t.token_ids) for t in out])
            except InvalidRequestError as e:
                raise ApiError(400, type(e).__name__, e.message, e.field) from None
        return out

    # ---- chat (/v1/chat/completions, sidecar/api/openai.py): the same limits, one rendered prompt ----
    def check_chat(self, n: int, chars: int, messages: int = 0) -> None:
        """A chat call's cheap checks, before its template is rendered: the sequences it asks for (its
        n; 400 naming n), its number of messages and their characters (400 naming messages). The rendered
        prompt is checked again by `encode_chat`; this refuses a huge chat before any template runs."""
        if messages > self.max_chat_messages:
            raise ApiError(400, "InvalidRequestError", f"has {messages} messages; at most "
                           f"{self.max_chat_messages} are accepted (the sidecar's --max-chat-messages)", "messages")
        if n > self.max_request_sequences:
            raise ApiError(400, "InvalidRequestError", f"asks for {n} sequences; one call may ask for at most "
                           f"{self.max_request_sequences} (the sidecar's --max-request-sequences): split it into "
                           "several calls", "n")
        if chars > self.max_prompt_chars:
            raise ApiError(400, "InvalidRequestError", f"have {chars} characters; at most {self.max_prompt_chars} "
                           "are accepted (the sidecar's --max-prompt-chars); send shorter messages", "messages")

    def encode_chat(self, text: str) -> TokenizedPrompt:
        """A rendered chat prompt checked as a completion's text prompt is (characters, Unicode, token ids)
        and tokenized without adding special tokens (the template wrote them); ApiError 400 naming
        messages. Runs in a worker thread, like `encode`."""
        try:
            check_text(text, "messages", self.max_prompt_chars)
            if self.tokenizer is None:
                raise InvalidRequestError("messages", "this model has no tokenizer.json: chat needs one (send "
                                                      "token ids to /generate instead)")
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            check_token_ids(ids, self.vocab_size, "messages")
        except InvalidRequestError as e:
            raise ApiError(400, type(e).__name__, e.message, e.field) from None
        return TokenizedPrompt(None, ids)  # None: the output carries no prompt text, as before


async def encode_group(intake: Intake, prompts: Sequence[Any],
                       params: Sequence[SamplingParams]) -> list[TokenizedPrompt]:
    """`intake.encode` on a tokenizer thread, after the checks that cost nothing here: the sequences, the
    answer's size and each text prompt's length (len() of a str is O(1)), so a call that will be refused
    for its size never waits for, nor holds, a tokenizer thread."""
    intake.check_sequences(params)
    size = 0
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str) and len(prompt) > intake.max_prompt_chars:
            _at(i, check_text, prompt, "prompt", intake.max_prompt_chars)
        size += len(prompt) if isinstance(prompt, (str, list)) else 0
    return await intake.run_text(size, intake.encode, prompts, params)


def _at(index: int, check: Any, *args: Any) -> None:
    try:
        check(*args)
    except InvalidRequestError as e:
        raise _bad(index, e) from None


def _bad(index: int, e: InvalidRequestError) -> ApiError:
    return ApiError(400, type(e).__name__, e.message, e.field, index=index)


def build_intake(tokenizer: Any, config: Any, plan: RankPlan) -> Intake:
    """The Intake of a sidecar: its tokenizer (inference.text.tokenizer.Tokenizer or None), its LaunchConfig's
    limits and the model facts of rank 0's startup plan."""
    pool = TextPool(config.text_workers or default_workers(), config.max_text_queue)
    return Intake(GilFreeTokenizer(tokenizer) if tokenizer is not None else None, plan.vocab_size,
                  plan.max_model_len, config.max_prompt_chars, config.max_request_sequences, config.max_stops,
                  config.max_stop_chars, config.max_response_tokens, config.max_chat_messages, pool,
                  plan.routing_row_bytes)
