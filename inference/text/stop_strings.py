"""Stop strings found while a completion's text grows: one automaton per request, one cursor per sequence.

`StopStrings` is an Aho-Corasick automaton over a request's stop strings, built once (linear in their
total characters) and shared by the request's n sequences. `StopDetector` feeds it each new piece of a
sequence's detokenized text, so a step costs time linear in the new characters whatever the number of
stop strings (a scan of every stop string per token made one request with millions of them outlast
the step timeout). The answer is the one a search of the whole text would give: the earliest-starting
stop string that the new characters complete, ties going to the stop string listed first; the caller
cuts the output there (the stop string itself is not returned, as in OpenAI's API and vLLM).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from inference.text.tokenizer import IncrementalDetokenizer, Tokenizer


class StopStrings:
    """The automaton of one request's stop strings (non-empty, as SamplingParams validates them)."""

    def __init__(self, stops: Sequence[str]) -> None:
        assert all(stops), "stop strings are validated non-empty by SamplingParams"
        self.stops = tuple(stops)
        self._goto: list[dict[str, int]] = [{}]
        # _best[state]: the longest stop string ending at this state (the earliest start), or -1
        self._best: list[int] = [-1]
        for i, stop in enumerate(self.stops):
            node = 0
            for ch in stop:
                nxt = self._goto[node].get(ch)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[node][ch] = nxt
                    self._goto.append({})
                    self._best.append(-1)
                node = nxt
            if self._best[node] == -1:  # a repeated stop string keeps its first position (ties)
                self._best[node] = i
        self._fail = [0] * len(self._goto)
        self._link_failures()

    def _link_failures(self) -> None:
        """Breadth first, so a state's failure target (shallower) is complete before the state."""
        goto, fail, best = self._goto, self._fail, self._best
        queue = deque(goto[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(ch, 0) if node else 0
                if best[child] == -1:
                    best[child] = best[fail[child]]
                queue.append(child)

    def scan(self, state: int, text: str, offset: int) -> tuple[int, tuple[int, str] | None]:
        """Advance `state` over `text`, which begins at index `offset` of the whole text. Returns the new
        state and the earliest-starting stop string ending inside `text`: (its index in the whole text,
        the stop string), or None."""
        goto, fail, best, stops = self._goto, self._fail, self._best, self.stops
        hit: tuple[int, int] | None = None  # (start, index in stops)
        for j, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            b = best[state]
            if b >= 0:
                key = (offset + j + 1 - len(stops[b]), b)
                if hit is None or key < hit:
                    hit = key
        return state, (None if hit is None else (hit[0], stops[hit[1]]))


class StopDetector:
    """One sequence's text as tokens arrive and the stop string it completes, if any."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Iterable[int], stops: StopStrings) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, list(prompt_ids))
        self._stops = stops
        self._state = 0

    @property
    def text(self) -> str:
        return self._detok.text

    def add(self, token_ids: Sequence[int]) -> tuple[int, str] | None:
        """Feed new tokens; (index in the text, stop string) of the stop they complete, or None."""
        offset = len(self._detok.text)
        delta = self._detok.add(token_ids)
        self._state, hit = self._stops.scan(self._state, delta, offset)
        return hit
