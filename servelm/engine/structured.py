"""Structured output in the engine: grammars compiled off the engine loop and cached by hash, a token mask applied
to the logits rows that have a grammar, and one matcher per sequence.

Two grammar backends do the work, chosen by the engine setting `structured_output_backend`:

- llguidance (a base dependency: a small Rust wheel) builds its grammars lazily, so a new schema costs
  milliseconds, and computes each step's mask with an Earley parser over a token trie;
- xgrammar (the `structured` extra; it needs triton on Linux x86-64, about 1 GB) compiles each grammar ahead
  into per-state token masks, so a step's mask is mostly a table lookup once compiled (and its CPU kernel
  applies a bitmask fastest: see `load_apply_kernel`).

`auto` takes llguidance (see `resolve_backend`). Both fill the same bitmask (bit t of row r set: token t is
allowed), which `apply_bitmask` turns into -inf logits on whatever device the logits are (on the CPU with
xgrammar's kernel where xgrammar is installed, whichever backend filled it).

The backend's package is imported on the first request that has a grammar, in the compile thread, so an engine
that never sees one never pays for it, and one that does keeps stepping meanwhile.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from servelm.engine.json_schema import check_schema, for_llguidance, lengths_as_patterns
from servelm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

    from servelm.engine.sequence import Sequence

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "llguidance", "xgrammar")
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)
# JSON with no free whitespace (a small model may otherwise emit spaces and newlines until max_tokens), and the
# same separators from both backends: `{"a": 1, "b": 2}`.
_XGR_JSON = {"any_whitespace": False}
_LLG_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[03:07:55] /path/file.cc:83: " before a message


def installed(backend: str) -> bool:
    """Whether a backend's package can be imported (without importing it: xgrammar takes seconds)."""
    return importlib.util.find_spec(backend) is not None


def resolve_backend(setting: str) -> str:
    """The backend a setting names: `auto` is llguidance, which every install has; on a 49k vocabulary it fills
    a step's mask as fast as xgrammar for one row and 3 to 5 times faster for 8 to 32 rows (in parallel, both;
    bench/grammar_sampler.py --backends), and compiles a new grammar in milliseconds rather than tens."""
    if setting not in BACKENDS:
        raise ValueError(f"structured output backend must be one of {', '.join(BACKENDS)}, got {setting!r}")
    return "llguidance" if setting == "auto" else setting


def install_hint(backend: str = "xgrammar") -> str:
    if backend == "xgrammar":
        return "the xgrammar structured output backend needs the xgrammar package: pip install 'servelm[structured]'"
    return f"structured output needs the {backend} package: pip install {backend}"


class GrammarCache:
    """Compiles grammars in one background thread, each distinct grammar once (keyed by its hash)."""

    def __init__(self, vocab_size: int, tokenizer_loader: Callable[[], Any], backend: str = "auto") -> None:
        self.vocab_size = vocab_size
        self.tokenizer_loader = tokenizer_loader
        self.backend = resolve_backend(backend)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="servelm-grammar")
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler: _XGrammarCompiler | _LLGuidanceCompiler | None = None
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
            if not installed(self.backend):
                raise ValueError(install_hint(self.backend))
            cls = _XGrammarCompiler if self.backend == "xgrammar" else _LLGuidanceCompiler
            self._compiler = cls(self.tokenizer_loader(), self.vocab_size, eos_ids)
            load_apply_kernel()
        return self._compiler

    def _compile(self, spec: StructuredOutputsParams, eos_ids: frozenset[int]):
        compiler = self._get_compiler(eos_ids)
        if spec.kind == "json":
            check_schema(json.loads(spec.json))  # a keyword neither backend would enforce: a ValueError naming it
        grammar = compiler.compile(spec)
        self.num_compiled += 1
        return grammar

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def ebnf_literal(text: str) -> str:
    """`text` as an EBNF (or Lark) string literal: JSON's escapes, which both backends read the same way."""
    return json.dumps(text, ensure_ascii=False)


# -- xgrammar ------------------------------------------------------------------------------------------------

class _XGrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int]) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(eos_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, spec: StructuredOutputsParams):
        compiler, kind = self.compiler, spec.kind
        try:
            if kind == "json":
                schema = lengths_as_patterns(json.loads(spec.json))
                return compiler.compile_json_schema(json.dumps(schema), **_XGR_JSON)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', **_XGR_JSON)
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar("root ::= " + " | ".join(ebnf_literal(c) for c in spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except Exception as e:  # xgrammar raises RuntimeError for a grammar it cannot parse or convert
            text = str(e).strip()
            message = _XGR_PREFIX.sub("", text.splitlines()[0] if text else type(e).__name__)
            raise ValueError(f"invalid structured output {kind}: {message}") from None


# -- llguidance ----------------------------------------------------------------------------------------------

class _LLGuidanceCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int]) -> None:
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                      eos_token=sorted(eos_ids) or None)
        self.eos_ids = frozenset(self.tokenizer.eos_tokens)

    def compile(self, spec: StructuredOutputsParams) -> LLGuidanceGrammar:
        import llguidance

        kind, matcher_cls = spec.kind, llguidance.LLMatcher
        try:
            if kind == "json":
                grammar = matcher_cls.grammar_from_json_schema(for_llguidance(json.loads(spec.json)),
                                                             overrides=_LLG_JSON)
            elif kind == "json_object":
                grammar = matcher_cls.grammar_from_json_schema('{"type": "object"}', overrides=_LLG_JSON)
            elif kind == "regex":
                grammar = matcher_cls.grammar_from_regex(spec.regex)
            elif kind == "choice":
                grammar = matcher_cls.grammar_from_lark("start: " + " | ".join(ebnf_literal(c) for c in spec.choice))
            else:  # GBNF / xgrammar's EBNF (`root ::= ...`), or Lark (`start: ...`)
                grammar = llguidance.grammar_from("grammar", spec.grammar)
            # building the matcher builds the parser and lexer: here, off the engine loop, once per grammar
            proto = matcher_cls(self.tokenizer, grammar, log_level=0)
        except ValueError as e:  # the GBNF-to-Lark conversion, or a schema that is not JSON
            raise ValueError(f"invalid structured output {kind}: {_llg_message(str(e))}") from None
        if proto.is_error():
            raise ValueError(f"invalid structured output {kind}: {_llg_message(proto.get_error())}")
        return LLGuidanceGrammar(proto, self.eos_ids)


def _llg_message(text: str) -> str:
    """An llguidance error on one line: its parts joined, the source excerpts (lines of `^` or `|`) left out."""
    lines = [ln.strip() for ln in text.strip().splitlines()]
    kept = [ln for ln in lines if ln and not re.fullmatch(r"[\s^~|]*|\d*\s*\|.*", ln)]
    return " ".join(kept)[:500] or "the grammar is invalid"


class LLGuidanceGrammar:
    """A compiled llguidance grammar: a matcher in its start state, copied for each new sequence."""

    def __init__(self, proto: Any, eos_ids: frozenset[int]) -> None:
        self.proto, self.eos_ids = proto, eos_ids

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.proto.deep_copy(), self.eos_ids)


class LLGuidanceMatcher:
    """An llguidance LLMatcher with xgrammar's GrammarMatcher methods that the engine calls: terminated once it
    has accepted a stop token (the grammar complete), as xgrammar's is."""

    __slots__ = ("m", "eos_ids", "terminated")

    def __init__(self, m: Any, eos_ids: frozenset[int]) -> None:
        self.m, self.eos_ids, self.terminated = m, eos_ids, False

    def accept_token(self, token: int) -> bool:
        if self.terminated or not self.m.consume_token(token):
            return False
        self.terminated = token in self.eos_ids
        return True

    def is_terminated(self) -> bool:
        return self.terminated

    def reset(self) -> None:
        self.m.reset()
        self.terminated = False

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        row = bitmask[index]
        self.m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)


def new_matcher(compiled) -> Any:
    if isinstance(compiled, LLGuidanceGrammar):
        return compiled.matcher()
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


# -- the mask --------------------------------------------------------------------------------------------------

_bitmask = None  # the sampler's bitmask buffer (the engine loop's thread only)
_pools: dict[str, Any] = {}  # each backend's thread pool for filling several rows at once


def _threads() -> int:
    import os

    return max(1, min(8, len(os.sched_getaffinity(0))))


def _pool(backend: str):
    pool = _pools.get(backend)
    if pool is None:
        if backend == "llguidance":
            import llguidance

            pool = llguidance.LLExecutor(num_threads=_threads())
        else:
            import xgrammar as xgr

            pool = xgr.BatchGrammarMatcher(max_threads=_threads())
        _pools[backend] = pool
    return pool


def fill_bitmask(bitmask: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    """Row r of the (CPU, int32, contiguous) bitmask: the tokens seqs[r]'s grammar allows next, for each r in
    rows. Several rows fill in parallel, in the backend's threads (outside the GIL)."""
    llg = [r for r in rows if isinstance(seqs[r].matcher, LLGuidanceMatcher)]
    xgr = [r for r in rows if not isinstance(seqs[r].matcher, LLGuidanceMatcher)]
    if len(llg) == 1:
        seqs[llg[0]].matcher.fill_next_token_bitmask(bitmask, llg[0])
    elif llg:
        _pool("llguidance").unsafe_compute_mask_ptr([(seqs[r].matcher.m, r) for r in llg], bitmask.data_ptr(),
                                                    bitmask.shape[1] * 4, bitmask.shape[0])
    if len(xgr) == 1:
        seqs[xgr[0]].matcher.fill_next_token_bitmask(bitmask, xgr[0])
    elif xgr:
        _pool("xgrammar").batch_fill_next_token_bitmask([seqs[r].matcher for r in xgr], bitmask, xgr)


_bias_table = None  # [256, 8] float32: the 0 / -inf bias of each bit of a byte (bit 0 first)
_bias = None  # the bias buffer, reused: a fresh one each step would cost more in page faults than the rest
_xgr_apply = None  # xgrammar's CPU kernel, where xgrammar is installed (see load_apply_kernel)


def load_apply_kernel() -> None:
    """Use xgrammar's CPU kernel to apply the bitmask, whichever backend fills it, where xgrammar is installed:
    it writes only the -inf of the banned tokens, about 3 times faster than the numpy path on a grammar's masks
    (bench/grammar_sampler.py --backends). Imported here, in the compile thread (1-2 s), never on the loop."""
    global _xgr_apply
    if _xgr_apply is None and installed("xgrammar"):
        try:
            import xgrammar as xgr
        except Exception as e:  # a broken install: the numpy path does the same
            logger.warning("xgrammar does not import (%s); its bitmask kernel is not used", e)
            return
        _xgr_apply = xgr.apply_token_bitmask_inplace


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set logits[r, t] to -inf, for each r in rows, where bit t of bitmask row r is clear. float32 logits on
    any device; the bitmask is on the CPU, one row per logits row (bits past the vocabulary's end are
    ignored). On the CPU: xgrammar's kernel where it is installed, else `_apply_numpy`; on another device the
    bitmask rows are copied over and unpacked there."""
    n = len(rows)
    all_rows = n == logits.shape[0] and rows == list(range(n))
    if logits.device.type == "cpu":
        if _xgr_apply is not None:
            _xgr_apply(logits, bitmask, indices=None if all_rows else rows)
        else:
            _apply_numpy(logits, bitmask[:n] if all_rows else bitmask[rows], rows, all_rows)
        return
    words = bitmask[:n] if all_rows else bitmask[rows]
    _apply_unpacked(logits, words.to(logits.device, non_blocking=True), rows, all_rows)


def _apply_numpy(logits: torch.Tensor, words: torch.Tensor, rows: list[int], all_rows: bool) -> None:
    """apply_bitmask with numpy and torch only: each byte of the rows' words picks its 8 bias values (0 or
    -inf) from a table, which one add puts into the logits (an add vectorizes, where a masked fill does not:
    about 0.06 ms a 49k-token row)."""
    import numpy as np
    import torch

    global _bias_table, _bias
    n, vocab = len(rows), logits.shape[1]
    if _bias_table is None:
        allowed = ((np.arange(256)[:, None] >> np.arange(8)) & 1) == 1
        _bias_table = np.where(allowed, 0.0, -np.inf).astype(np.float32)
    nbytes = words.shape[1] * 4
    if _bias is None or _bias.shape[0] < n or _bias.shape[1] != nbytes:
        _bias = np.empty((max(n, 64), nbytes, 8), dtype=np.float32)
    bias = _bias[:n]
    # mode="clip" (the indices are bytes: always in range) makes `out` unbuffered; bytes in little-endian order
    np.take(_bias_table, words.numpy().view(np.uint8), axis=0, out=bias, mode="clip")
    bias_t = torch.from_numpy(bias.reshape(n, nbytes * 8)[:, :vocab])
    if all_rows:
        logits.add_(bias_t)
    else:
        idx = torch.tensor(rows)
        logits[idx] = logits[idx].add_(bias_t)


def _apply_unpacked(logits: torch.Tensor, words: torch.Tensor, rows: list[int], all_rows: bool) -> None:
    """apply_bitmask on a GPU (or any device): the rows' words, already there, unpacked with torch."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    banned = ((words.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :logits.shape[1]] == 0
    if all_rows:
        logits.masked_fill_(banned, float("-inf"))
    else:
        idx = torch.tensor(rows, device=logits.device)
        logits[idx] = logits[idx].masked_fill_(banned, float("-inf"))


def mask_logits(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> torch.Tensor:
    """Set to -inf, in the listed rows only, every token their sequence's grammar does not allow next."""
    import torch

    global _bitmask
    if logits.dtype != torch.float32:
        logits = logits.float()
    rows_needed, vocab = logits.shape
    if _bitmask is None or _bitmask.shape[0] < rows_needed or _bitmask.shape[1] != (vocab + 31) // 32:
        _bitmask = torch.full((max(rows_needed, 64), (vocab + 31) // 32), -1, dtype=torch.int32)  # kept
    bitmask = _bitmask[:rows_needed]  # rows without a grammar are never read
    fill_bitmask(bitmask, seqs, rows)
    apply_bitmask(logits, bitmask, rows)
    return logits
