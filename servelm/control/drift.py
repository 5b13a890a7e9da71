"""Data drift per model: a reference window against the live window.

Features per request: prompt length and output length (tokens), character classes of the prompt (letters by
script, digits, space, punctuation), prompt token ids (hashed into buckets: id mod `token_buckets`) and, when
an embedding model is available, the prompt's embedding vector. Statistics:

- PSI (population stability index) for every feature but embeddings: numeric ones over the reference's
  quantile bins, categorical ones over their categories (0.1 is usually read as a moderate shift, 0.2 as a
  significant one);
- two-sample Kolmogorov-Smirnov (scipy) for the lengths;
- MMD (maximum mean discrepancy, RBF kernel with the median-distance bandwidth, numpy) with a permutation
  p-value for the embeddings.

Windows are bounded (the last `window` requests; categorical totals kept as running sums). `report()` gives
each feature's statistics and alert flag; the caller exports them as metrics and in the admin API.

Concept drift (`ConceptMonitor`, per version): the feedback score (one-sided Welch t: lower now), the
refusal and empty-output rates (one-sided two-proportion z: higher now) and the finish-reason mix
(chi-square test of the 2 x k table), reference against live window.
"""

from __future__ import annotations

import re
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy import stats

from servelm.control.experiments import Welford, two_proportion_z, welch

# (name, first code point, last code point) for letters by script; everything else by Unicode category
SCRIPTS = (("latin_ext", 0x00C0, 0x024F), ("greek", 0x0370, 0x03FF), ("cyrillic", 0x0400, 0x04FF),
           ("hebrew", 0x0590, 0x05FF), ("arabic", 0x0600, 0x06FF), ("devanagari", 0x0900, 0x097F),
           ("hangul", 0xAC00, 0xD7AF), ("kana", 0x3040, 0x30FF), ("cjk", 0x4E00, 0x9FFF))
CHAR_CLASSES = ("ascii_letter", *(s[0] for s in SCRIPTS), "digit", "space", "punct", "other")
_INDEX = {c: i for i, c in enumerate(CHAR_CLASSES)}


def char_class(ch: str) -> str:
    """The class of one character."""
    if ch.isascii():
        if ch.isalpha():
            return "ascii_letter"
        if ch.isdigit():
            return "digit"
        if ch.isspace():
            return "space"
        return "punct" if ch.isprintable() else "other"
    o = ord(ch)
    for name, lo, hi in SCRIPTS:
        if lo <= o <= hi:
            return name
    if ch.isdigit():
        return "digit"
    return "space" if ch.isspace() else "other"


def char_profile(text: str) -> np.ndarray:
    """Counts of each character class in `text`."""
    out = np.zeros(len(CHAR_CLASSES), dtype=np.int64)
    for ch in text:
        out[_INDEX[char_class(ch)]] += 1
    return out


def psi(ref_counts: np.ndarray, live_counts: np.ndarray, eps: float = 1e-4) -> float:
    """PSI between two count (or frequency) vectors over the same categories; empty categories are floored
    at `eps` so a category seen on one side only contributes a large but finite term."""
    r = np.maximum(np.asarray(ref_counts, float) / max(np.sum(ref_counts), 1e-12), eps)
    lv = np.maximum(np.asarray(live_counts, float) / max(np.sum(live_counts), 1e-12), eps)
    return float(np.sum((lv - r) * np.log(lv / r)))


def psi_numeric(ref: np.ndarray, live: np.ndarray, bins: int = 10) -> float:
    """PSI of a numeric feature over the reference's quantile bins (ties merge bins)."""
    edges = np.unique(np.quantile(ref, np.linspace(0, 1, bins + 1)[1:-1]))
    edges = np.concatenate([[-np.inf], edges, [np.inf]])
    return psi(np.histogram(ref, edges)[0], np.histogram(live, edges)[0])


def ks(ref: np.ndarray, live: np.ndarray) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov: (statistic, p-value)."""
    r = stats.ks_2samp(ref, live)
    return float(r.statistic), float(r.pvalue)


def _rbf(a: np.ndarray, b: np.ndarray, gamma: float) -> np.ndarray:
    d = np.sum(a * a, 1)[:, None] + np.sum(b * b, 1)[None, :] - 2 * a @ b.T
    return np.exp(-gamma * np.maximum(d, 0.0))


def mmd(x: np.ndarray, y: np.ndarray, *, permutations: int = 200, seed: int = 0) -> tuple[float, float]:
    """Unbiased MMD^2 between samples x (n, d) and y (m, d) with an RBF kernel (bandwidth: the median
    pairwise distance of the pooled sample) and its permutation p-value: (mmd2, p)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    z = np.concatenate([x, y])
    n, m = len(x), len(y)
    sq = np.sum(z * z, 1)[:, None] + np.sum(z * z, 1)[None, :] - 2 * z @ z.T
    med = np.median(sq[np.triu_indices(len(z), 1)])
    k = _rbf(z, z, 1.0 / (2 * med) if med > 0 else 1.0)

    def stat(ix: np.ndarray, iy: np.ndarray) -> float:
        kxx, kyy, kxy = k[np.ix_(ix, ix)], k[np.ix_(iy, iy)], k[np.ix_(ix, iy)]
        return float((kxx.sum() - np.trace(kxx)) / (n * (n - 1)) + (kyy.sum() - np.trace(kyy)) / (m * (m - 1))
                     - 2 * kxy.mean())

    observed = stat(np.arange(n), np.arange(n, n + m))
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(permutations):
        p = rng.permutation(n + m)
        hits += stat(p[:n], p[n:]) >= observed
    return observed, (1 + hits) / (1 + permutations)


@dataclass
class DriftThresholds:
    """When a feature alerts; and how much data a comparison needs."""

    psi: float = 0.2
    ks_p: float = 0.01
    ks_stat: float = 0.1  # the KS distance must also be this large (huge windows make tiny shifts significant)
    mmd_p: float = 0.01
    min_samples: int = 50  # per window, per feature
    bins: int = 10
    token_buckets: int = 256
    mmd_points: int = 200  # embeddings compared (the most recent of each window)
    mmd_permutations: int = 200


class Window:
    """The features of the last `size` requests (categorical totals kept as running sums)."""

    def __init__(self, size: int, token_buckets: int) -> None:
        self.prompt_len: deque[int] = deque(maxlen=size)
        self.output_len: deque[int] = deque(maxlen=size)
        self.chars: deque[np.ndarray] = deque(maxlen=size)
        self.tokens: deque[np.ndarray] = deque(maxlen=size)
        self.embeddings: deque[np.ndarray] = deque(maxlen=size)
        self.char_total = np.zeros(len(CHAR_CLASSES), dtype=np.int64)
        self.token_total = np.zeros(token_buckets, dtype=np.int64)
        self.buckets = token_buckets

    def copy(self) -> Window:
        """A frozen copy (the deques and totals, not the arrays they hold, which are never changed in place):
        what a report in another thread reads while the event loop keeps adding to this one."""
        w = Window.__new__(Window)
        for k in ("prompt_len", "output_len", "chars", "tokens", "embeddings"):
            setattr(w, k, getattr(self, k).copy())
        w.char_total, w.token_total, w.buckets = self.char_total.copy(), self.token_total.copy(), self.buckets
        return w

    @staticmethod
    def _push(q: deque, total: np.ndarray, v: np.ndarray) -> None:
        if len(q) == q.maxlen:
            total -= q[0]
        q.append(v)
        total += v

    def add(self, *, prompt: str | None = None, prompt_tokens: Sequence[int] | None = None,
            output_tokens: int | None = None, embedding: Sequence[float] | None = None) -> None:
        if prompt_tokens is not None:
            self.prompt_len.append(len(prompt_tokens))
            ids = np.asarray(prompt_tokens, dtype=np.int64) % self.buckets
            self._push(self.tokens, self.token_total, np.bincount(ids, minlength=self.buckets))
        if prompt is not None:
            self._push(self.chars, self.char_total, char_profile(prompt))
        if output_tokens is not None:
            self.output_len.append(int(output_tokens))
        if embedding is not None:
            self.embeddings.append(np.asarray(embedding, dtype=float))


class DriftMonitor:
    """One model's reference and live windows. Feed `observe` per request; `set_reference()` freezes the
    live window as the reference (or feed the reference directly with `observe(..., reference=True)`)."""

    def __init__(self, model: str, thresholds: DriftThresholds | None = None, window: int = 5000) -> None:
        self.model, self.th, self.size = model, thresholds or DriftThresholds(), window
        self.reference = Window(window, self.th.token_buckets)
        self.live = Window(window, self.th.token_buckets)
        self.embedding_epoch = 0  # changes whenever either embedding window does (a cached MMD is stale then)

    def observe(self, *, reference: bool = False, **features: Any) -> None:
        """Add one request's features (keyword arguments as `Window.add`)."""
        (self.reference if reference else self.live).add(**features)
        if features.get("embedding") is not None:
            self.embedding_epoch += 1

    def snapshot(self) -> DriftMonitor:
        """A copy of both windows, taken where they are fed (the event loop), to report on in a thread."""
        snap = DriftMonitor(self.model, self.th, window=0)
        snap.size, snap.reference, snap.live = self.size, self.reference.copy(), self.live.copy()
        snap.embedding_epoch = self.embedding_epoch
        return snap

    def set_reference(self) -> None:
        """The live window becomes the reference; a new live window starts."""
        self.reference, self.live = self.live, Window(self.size, self.th.token_buckets)
        self.embedding_epoch += 1

    def embedding_report(self) -> dict[str, Any]:
        """The prompt-embedding feature alone: MMD^2 and its permutation p-value over the most recent
        `mmd_points` of each window (the costly part of a report: O(points^2 x permutations))."""
        th, ref, live = self.th, self.reference, self.live
        f: dict[str, Any] = {"n_ref": len(ref.embeddings), "n_live": len(live.embeddings), "alert": False}
        if min(len(ref.embeddings), len(live.embeddings)) >= th.min_samples:
            x = np.stack(list(ref.embeddings)[-th.mmd_points:])
            y = np.stack(list(live.embeddings)[-th.mmd_points:])
            f["mmd2"], f["mmd_p"] = mmd(x, y, permutations=th.mmd_permutations)
            f["alert"] = bool(f["mmd_p"] < th.mmd_p)
        f["evaluated"] = "mmd2" in f
        return f

    def report(self, embedding: dict[str, Any] | None = None) -> dict[str, Any]:
        """Per feature: statistics, sample counts and `alert`; `alert` overall when any feature alerts.
        `embedding`: the embedding feature's result computed before (`embedding_report`), else it is computed."""
        th, ref, live = self.th, self.reference, self.live
        out: dict[str, Any] = {}
        for name in ("prompt_len", "output_len"):
            r, lv = np.asarray(getattr(ref, name), float), np.asarray(getattr(live, name), float)
            f: dict[str, Any] = {"n_ref": len(r), "n_live": len(lv)}
            if min(len(r), len(lv)) >= th.min_samples:
                d, p = ks(r, lv)
                f.update(psi=psi_numeric(r, lv, th.bins), ks=d, ks_p=p)
                f["alert"] = bool(f["psi"] > th.psi or (p < th.ks_p and d > th.ks_stat))
            out[name] = f
        for name, rq, lq, rt, lt in (("char_classes", ref.chars, live.chars, ref.char_total, live.char_total),
                                     ("token_ids", ref.tokens, live.tokens, ref.token_total, live.token_total)):
            f = {"n_ref": len(rq), "n_live": len(lq)}
            if min(len(rq), len(lq)) >= th.min_samples:
                f["psi"] = psi(rt, lt)
                f["alert"] = bool(f["psi"] > th.psi)
            out[name] = f
        for f in out.values():
            f.setdefault("alert", False)
            f["evaluated"] = "psi" in f
        out["embedding"] = dict(embedding) if embedding is not None else self.embedding_report()
        return {"model": self.model, "thresholds": asdict(th), "features": out,
                "alert": any(f["alert"] for f in out.values())}


REFUSAL_RE = re.compile(r"^\W*(?:I(?:'m| am) (?:sorry|unable|not able)|I can(?:not|'t)|I won't|As an AI)\b", re.I)


@dataclass
class ConceptThresholds:
    alpha: float = 0.01
    min_samples: int = 50  # per window, per signal
    margin: float = 0.02  # rates and feedback must move by more than this too


class _Outcomes:
    def __init__(self, size: int) -> None:
        self.feedback: deque[float] = deque(maxlen=size)
        self.refusal: deque[bool] = deque(maxlen=size)
        self.empty: deque[bool] = deque(maxlen=size)
        self.finish: deque[str] = deque(maxlen=size)


class ConceptMonitor:
    """One version's outcomes, reference against live window (the last `window` requests)."""

    def __init__(self, name: str, thresholds: ConceptThresholds | None = None, window: int = 5000) -> None:
        self.name, self.th, self.size = name, thresholds or ConceptThresholds(), window
        self.reference, self.live = _Outcomes(window), _Outcomes(window)

    def observe(self, *, output: str | None = None, finish_reason: str | None = None,
                feedback: float | None = None, reference: bool = False) -> None:
        w = self.reference if reference else self.live
        if output is not None:
            w.empty.append(not output.strip())
            w.refusal.append(bool(REFUSAL_RE.match(output)))
        if finish_reason is not None:
            w.finish.append(finish_reason)
        if feedback is not None:
            w.feedback.append(float(feedback))

    def set_reference(self) -> None:
        self.reference, self.live = self.live, _Outcomes(self.size)

    def snapshot(self) -> ConceptMonitor:
        """A copy of both windows (taken on the loop that feeds them) to report on in a thread."""
        snap = ConceptMonitor(self.name, self.th, window=0)
        snap.size = self.size
        for src, dst in ((self.reference, snap.reference), (self.live, snap.live)):
            for k in ("feedback", "refusal", "empty", "finish"):
                setattr(dst, k, getattr(src, k).copy())
        return snap

    def report(self) -> dict[str, Any]:
        th, ref, live = self.th, self.reference, self.live
        out: dict[str, Any] = {}
        for name in ("refusal", "empty"):
            r, lv = getattr(ref, name), getattr(live, name)
            f: dict[str, Any] = {"n_ref": len(r), "n_live": len(lv), "alert": False}
            if min(len(r), len(lv)) >= th.min_samples:
                _, p = two_proportion_z(sum(lv), len(lv), sum(r), len(r), "greater")
                f.update(ref_rate=sum(r) / len(r), live_rate=sum(lv) / len(lv), p=p)
                f["alert"] = bool(p < th.alpha and f["live_rate"] - f["ref_rate"] > th.margin)
            out[f"{name}_rate"] = f
        f = {"n_ref": len(ref.feedback), "n_live": len(live.feedback), "alert": False}
        if min(len(ref.feedback), len(live.feedback)) >= th.min_samples:
            wr, wl = Welford(), Welford()
            for x in ref.feedback:
                wr.add(x)
            for x in live.feedback:
                wl.add(x)
            _, p = welch(wl, wr, "less")
            f.update(ref_mean=wr.mean, live_mean=wl.mean, p=p)
            f["alert"] = bool(p < th.alpha and wr.mean - wl.mean > th.margin)
        out["feedback"] = f
        f = {"n_ref": len(ref.finish), "n_live": len(live.finish), "alert": False}
        if min(len(ref.finish), len(live.finish)) >= th.min_samples:
            cr, cl = Counter(ref.finish), Counter(live.finish)
            keys = sorted(set(cr) | set(cl))
            f.update(ref_mix={k: cr[k] / len(ref.finish) for k in keys},
                     live_mix={k: cl[k] / len(live.finish) for k in keys})
            if len(keys) > 1:
                f["p"] = float(stats.chi2_contingency([[cr[k] for k in keys], [cl[k] for k in keys]])[1])
                f["alert"] = bool(f["p"] < th.alpha and max(abs(f["live_mix"][k] - f["ref_mix"][k])
                                                             for k in keys) > th.margin)
        out["finish_reasons"] = f
        return {"version": self.name, "signals": out, "alert": any(x["alert"] for x in out.values())}
