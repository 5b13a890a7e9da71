"""Logprobs in the shapes OpenAI's chat and completions APIs return them. `as_ids` (vLLM's
return_tokens_as_token_ids) names each token "token_id:N" instead of by its text, which a token that is not
text on its own (part of a character, a special token) cannot be told by."""

from __future__ import annotations


def _value(lp) -> float:
    """A logprob as JSON can carry it: -inf (a token the sampling dropped, under --logprobs-mode
    processed_logprobs) as -9999.0, as vLLM writes it."""
    return max(lp.logprob, -9999.0)


def _name(tid: int, lp, as_ids: bool) -> str | None:
    return f"token_id:{tid}" if as_ids else lp.decoded_token


def chat_logprobs(token_ids: list[int], entries: list, k: int, as_ids: bool = False) -> dict:
    """Chat's {"content": [{token, logprob, bytes, top_logprobs}]} with the k most likely alternatives."""
    def item(t: int, lp) -> dict:
        text = _name(t, lp, as_ids) or ""
        return {"token": text, "logprob": _value(lp), "bytes": list(text.encode())}

    content = []
    for tid, pos in zip(token_ids, entries, strict=False):
        top = sorted(pos.items(), key=lambda kv: -kv[1].logprob)[:k]
        content.append({**item(tid, pos[tid]), "top_logprobs": [item(t, v) for t, v in top]})
    return {"content": content}


def completion_logprobs(token_ids: list[int], entries: list, offset: int, as_ids: bool = False) -> dict:
    """Completions' parallel lists (tokens, token_logprobs, top_logprobs, text_offset) from `offset`."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, pos in zip(token_ids, entries, strict=False):
        lp = pos[tid]
        tokens.append(_name(tid, lp, as_ids))
        token_lps.append(_value(lp))
        tops.append({_name(t, v, as_ids): _value(v) for t, v in pos.items()})
        offsets.append(offset)
        offset += len(lp.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def echo_logprobs(tok, ids: list[int], entries: list | None, k: int | None = None, as_ids: bool = False) -> dict:
    """The prompt's part of an echoed completion's logprobs: its tokens, their logprobs (None for the
    first, which nothing predicts), the top alternatives (the k best, where the engine computed more for the
    request's prompt_logprobs) and text offsets from 0."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = 0
    for j, tid in enumerate(ids):
        pos = entries[j] if entries is not None and j < len(entries) else None
        lp = pos[tid] if pos is not None else None
        text = lp.decoded_token if lp is not None else tok.decode([tid])
        tokens.append(f"token_id:{tid}" if as_ids else text)
        token_lps.append(_value(lp) if lp is not None else None)
        tops.append({_name(t, v, as_ids): _value(v) for t, v in pos.items() if k is None or t == tid or v.rank <= k}
                    if pos is not None else None)
        offsets.append(offset)
        offset += len(text or "")
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def with_echo(tok, ids: list[int], acc: dict, echo: bool, offset: int, k: int, as_ids: bool = False) -> dict:
    """A collected completion's logprobs (k alternatives each), preceded by the prompt's when it is echoed."""
    gen = completion_logprobs(acc["token_ids"], acc["logprobs"], offset, as_ids)
    if not echo:
        return gen
    head = echo_logprobs(tok, ids, acc.get("prompt_logprobs"), k, as_ids)
    return {k: head[k] + gen[k] for k in gen}


def prompt_logprobs(entries: list | None) -> list | None:
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}}, the token's own entry and the top alternatives."""
    if entries is None:
        return None
    return [None if pos is None else {str(t): {"logprob": _value(v), "rank": v.rank,
                                               "decoded_token": v.decoded_token} for t, v in pos.items()}
            for pos in entries]
