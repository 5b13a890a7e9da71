"""Incremental detokenization and stop strings for one sample.

A fast tokenizer whose decode is its Rust backend's streams through `tokenizers`' `DecodeStream`, primed with the
prompt's last tokens: one call per token, which holds back a multi-byte character split across tokens until it
is complete and renders leading spaces as the full text would. Other tokenizers (a subclass that rewrites its
decode, a slow one) decode a short sliding window of token ids twice (with and without the newest tokens) and
keep the difference, to the same effect.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_CONTEXT_TOKENS = 5  # prompt tokens decoded as left context for the first output token
# add_tokens: the last tokens fed one at a time. A character split across the end spans at most 4 bytes, each a
# token at worst; one decode of the rest gives the same text as token-by-token (tests/engine/test_detokenizer.py).
_TAIL_TOKENS = 8


def _holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that could still grow into a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def _plain_decode(tokenizer) -> bool:
    """Whether the tokenizer's decode is its backend's (no subclass rewrites the text)."""
    try:
        from transformers import TokenizersBackend
    except ImportError:  # older transformers: PreTrainedTokenizerFast
        from transformers import PreTrainedTokenizerFast as TokenizersBackend
    return isinstance(tokenizer, TokenizersBackend) and type(tokenizer)._decode is TokenizersBackend._decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool, stop: list[str],
                 include_stop_str_in_output: bool) -> None:
        self.tokenizer = tokenizer
        # A fast tokenizer's Rust backend decodes directly: transformers' decode() wraps the same call in
        # argument conversions that cost more than the decode itself (two calls per token per sample).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend_decode = backend.decode if isinstance(backend, Tokenizer) and _plain_decode(tokenizer) else None
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-(_CONTEXT_TOKENS + 1):])
        self._backend = backend
        self._stream = None
        if self._backend_decode is not None:
            try:
                self._stream = DecodeStream(ids=self.ids, skip_special_tokens=skip_special_tokens)
            except TypeError:  # tokenizers before 0.22: no priming with context ids
                self._stream = None
        self.prefix_offset = max(len(self.ids) - _CONTEXT_TOKENS, 0)
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.include_stop = include_stop_str_in_output

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int, check_stop: bool) -> str | None:
        """Append one token; returns the stop string if the text now contains one (text is cut there)."""
        old_len = len(self.text)
        if self._stream is not None:
            piece = self._stream.step(self._backend, token_id)
            if not piece:
                return None  # an incomplete character: wait for the next token
            self.text += piece
        else:
            self.ids.append(token_id)
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) <= len(prefix) or full.endswith("\ufffd"):
                return None  # an incomplete character: wait for the next token
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if not (self.stop and check_stop):
            return None
        # Only the new text and the few characters before it can contain a new match.
        search_from = max(0, old_len - self.max_stop_len + 1)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) != -1]
        if not hits:
            return None
        i, s = min(hits)
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        return s

    def add_tokens(self, token_ids: list[int]) -> None:
        """Append many tokens at once, with no stop string to look for (a request that wants only its final
        text). The stream decodes all but the last few in one call and the last few one by one, so a character
        split by the end is held back exactly as appending them one at a time holds it."""
        if self._stream is None:
            for t in token_ids:
                self.add_token(t, check_stop=False)
            return
        head, tail = token_ids[:-_TAIL_TOKENS], token_ids[-_TAIL_TOKENS:]
        pieces = [self._stream.step(self._backend, head)] if head else []
        pieces += [self._stream.step(self._backend, t) for t in tail]
        self.text += "".join(p for p in pieces if p)

    def stream_safe_len(self, finished: bool) -> int:
        """How much of the text can be shown now without ever leaking part of a stop string."""
        if finished or not self.stop:
            return len(self.text)
        return len(self.text) - _holdback(self.text, self.stop)
