"""Incremental detokenization reproduces the full decode and never streams part of a stop string."""

from __future__ import annotations

from servelm.engine.detokenizer import IncrementalDetokenizer


def test_incremental_text_equals_full_decode(tokenizer):
    text = "Héllo wörld 🙂 — naïve café, 日本語のテキスト!\n  indented"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    d = IncrementalDetokenizer(tokenizer, [1, 2, 3], True, [], False)
    seen = []
    for t in ids:
        d.add_token(t, check_stop=True)
        seen.append(d.text)
        assert "\ufffd" not in d.text  # partial UTF-8 characters are held back
    assert d.text == tokenizer.decode(ids)
    assert all(a == b[: len(a)] for a, b in zip(seen, seen[1:], strict=False))  # text only ever grows


def test_stop_string_holdback_for_streaming(tokenizer):
    ids = tokenizer("one two three four", add_special_tokens=False).input_ids
    d = IncrementalDetokenizer(tokenizer, [], True, ["three f"], False)
    shown = []
    hit = None
    for t in ids:
        hit = d.add_token(t, check_stop=True)
        shown.append(d.text[: d.stream_safe_len(finished=hit is not None)])
        if hit:
            break
    assert hit == "three f"
    assert d.text == "one two "
    assert all("thr" not in s for s in shown)  # nothing of the stop string was ever shown


def test_the_stream_and_the_window_give_the_same_text(tokenizer):
    """A fast tokenizer streams through tokenizers' DecodeStream; the sliding-window path (other tokenizers) gives
    the same text, token by token, over random ids (characters split across tokens, special tokens, spaces)."""
    import random

    rng = random.Random(5)
    vocab = tokenizer.backend_tokenizer.get_vocab_size()
    for _ in range(20):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 9))]
        ids = [rng.randrange(vocab) for _ in range(40)]
        for skip in (True, False):
            stream = IncrementalDetokenizer(tokenizer, prompt, skip, [], False)
            window = IncrementalDetokenizer(tokenizer, prompt, skip, [], False)
            assert stream._stream is not None
            window._stream = None
            for t in ids:
                stream.add_token(t, check_stop=False)
                window.add_token(t, check_stop=False)
                assert stream.text == window.text


def test_tokens_at_once_give_the_text_they_give_one_at_a_time(tokenizer):
    """add_tokens (a final-only request's tokens, detokenized when it finishes) gives the text add_token gives
    token by token: over random ids, byte tokens that split characters anywhere (the end included) and real
    text cut at every length, through the stream and through the window."""
    import random

    rng = random.Random(11)
    vocab = tokenizer.backend_tokenizer.get_vocab_size()
    text_ids = tokenizer("Héllo wörld 🙂 — naïve 日本語のテキスト 🙂🙂 café", add_special_tokens=False).input_ids
    cases = [text_ids[:k] for k in range(1, len(text_ids) + 1)]
    cases += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(60)]
    cases += [[rng.randrange(300) for _ in range(rng.randrange(1, 60))] for _ in range(60)]  # byte tokens
    for ids in cases:
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 9))]
        for skip in (True, False):
            for stream in (True, False):
                one = IncrementalDetokenizer(tokenizer, prompt, skip, [], False)
                once = IncrementalDetokenizer(tokenizer, prompt, skip, [], False)
                if not stream:
                    one._stream = once._stream = None
                for t in ids:
                    one.add_token(t, check_stop=False)
                once.add_tokens(ids)
                assert once.text == one.text, (ids, prompt, skip, stream)
