"""Structured output in the engine: grammars compiled with xgrammar off the engine loop and cached by hash,
a token mask applied to the logits rows that have a grammar, and one matcher per sequence.

xgrammar is imported on the first request that has a grammar (it takes seconds), in the compile thread, so
an engine that never sees one never pays for it, and one that does keeps stepping meanwhile.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from servelm.engine.json_schema import check_schema, lengths_as_patterns
from servelm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

    from servelm.engine.sequence import Sequence

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)
# JSON with no free whitespace: a small model may otherwise emit spaces and newlines until max_tokens.
_JSON_OPTS = {"any_whitespace": False}
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[03:07:55] /path/file.cc:83: " before a message


def install_hint() -> str:
    return "structured output needs the xgrammar package: pip install 'servelm[structured]'"


class GrammarCache:
    """Compiles grammars in one background thread, each distinct grammar once (keyed by its hash)."""

    def __init__(self, vocab_size: int, tokenizer_loader: Callable[[], Any]) -> None:
        self.vocab_size = vocab_size
        self.tokenizer_loader = tokenizer_loader
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="servelm-grammar")
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = None
        self.num_compiled = 0

    def submit(self, spec: StructuredOutputsParams, eos_ids: frozenset[int]) -> Future:
        """A future of the compiled grammar (already done when it is cached); its exception is a ValueError
        for a grammar that cannot be compiled."""
        key = spec.key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, spec, eos_ids)
            self._cache[key] = fut
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return fut

    def compile(self, spec: StructuredOutputsParams, eos_ids: frozenset[int]):
        """The compiled grammar, waiting for it (the offline API, which has no loop to keep going)."""
        return self.submit(spec, eos_ids).result()

    def _get_compiler(self, eos_ids: frozenset[int]):
        if self._compiler is None:
            try:
                import xgrammar as xgr
            except ImportError:
                raise ValueError(install_hint()) from None
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer_loader(), vocab_size=self.vocab_size,
                                                      stop_token_ids=sorted(eos_ids) or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def _compile(self, spec: StructuredOutputsParams, eos_ids: frozenset[int]):
        compiler = self._get_compiler(eos_ids)
        kind = spec.kind
        try:
            if kind == "json":
                schema = json.loads(spec.json)
                check_schema(schema)
                grammar = compiler.compile_json_schema(json.dumps(lengths_as_patterns(schema)), **_JSON_OPTS)
            elif kind == "json_object":
                grammar = compiler.compile_json_schema('{"type": "object"}', **_JSON_OPTS)
            elif kind == "regex":
                grammar = compiler.compile_regex(spec.regex)
            elif kind == "choice":
                grammar = compiler.compile_grammar("root ::= " + " | ".join(ebnf_literal(c) for c in spec.choice))
            else:
                grammar = compiler.compile_grammar(spec.grammar)
        except ValueError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError for a grammar it cannot parse or convert
            message = _XGR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            raise ValueError(f"invalid structured output {kind}: {message}") from None
        self.num_compiled += 1
        return grammar

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal (JSON's escapes, which xgrammar's EBNF reads the same way)."""
    return json.dumps(text, ensure_ascii=False)


def new_matcher(compiled) -> Any:
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


_bitmask = None  # the sampler's bitmask buffer (the engine loop's thread only)


def mask_logits(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> torch.Tensor:
    """Set to -inf, in the listed rows only, every token their sequence's grammar does not allow next."""
    import torch
    import xgrammar as xgr

    global _bitmask
    if logits.dtype != torch.float32:
        logits = logits.float()
    rows_needed, vocab = logits.shape
    if _bitmask is None or _bitmask.shape[0] < rows_needed or _bitmask.shape[1] != (vocab + 31) // 32:
        _bitmask = xgr.allocate_token_bitmask(max(rows_needed, 64), vocab)  # allocating costs ms: kept
    bitmask = _bitmask[:rows_needed]  # rows without a grammar are never read (indices)
    for r in rows:
        seqs[r].matcher.fill_next_token_bitmask(bitmask, r)
    # the bitmask is filled on the host; a GPU's logits take it there (a few KB), never the other way round
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
    return logits
