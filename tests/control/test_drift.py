"""Drift (servelm/control/drift.py): the statistics on known cases, and a monitor that flags a shifted
prompt distribution and not an unshifted one."""

import math

import numpy as np
import pytest
from scipy import stats

from servelm.control.drift import (
    CHAR_CLASSES,
    DriftMonitor,
    DriftThresholds,
    char_profile,
    ks,
    mmd,
    psi,
    psi_numeric,
)


def test_psi_known_values():
    assert psi([50, 50], [25, 75]) == pytest.approx(
        (0.25 - 0.5) * math.log(0.25 / 0.5) + (0.75 - 0.5) * math.log(0.75 / 0.5))
    assert psi([10, 20, 30], [1, 2, 3]) == pytest.approx(0.0)
    # a category seen on one side only: large and finite
    assert 1.0 < psi([100, 0], [50, 50]) < math.inf
    rng = np.random.default_rng(0)
    ref = rng.normal(0, 1, 5000)
    assert psi_numeric(ref, rng.normal(0, 1, 5000)) < 0.02 < 0.2 < psi_numeric(ref, rng.normal(1, 1, 5000))


def test_ks_is_scipys():
    rng = np.random.default_rng(1)
    a, b = rng.normal(0, 1, 300), rng.normal(0.3, 1, 200)
    ref = stats.ks_2samp(a, b)
    assert ks(a, b) == pytest.approx((ref.statistic, ref.pvalue))


def test_mmd_matches_the_definition_and_separates_shifted_samples():
    rng = np.random.default_rng(2)
    x, y = rng.normal(0, 1, (6, 2)), rng.normal(0, 1, (5, 2))
    z = np.concatenate([x, y])
    d2 = ((z[:, None, :] - z[None, :, :]) ** 2).sum(-1)
    gamma = 1 / (2 * np.median(d2[np.triu_indices(11, 1)]))
    k = np.exp(-gamma * d2)
    kxx, kyy, kxy = k[:6, :6], k[6:, 6:], k[:6, 6:]
    want = ((kxx.sum() - 6) / 30 + (kyy.sum() - 5) / 20 - 2 * kxy.mean())
    assert mmd(x, y, permutations=10)[0] == pytest.approx(want)
    same = mmd(rng.normal(0, 1, (150, 8)), rng.normal(0, 1, (150, 8)))
    shifted = mmd(rng.normal(0, 1, (150, 8)), rng.normal(0.5, 1, (150, 8)))
    assert same[1] > 0.05 and shifted[1] < 0.01 and shifted[0] > same[0]


def test_char_classes():
    prof = dict(zip(CHAR_CLASSES, char_profile("Hi, Мир 42 日本 éa\t"), strict=True))
    assert (prof["ascii_letter"], prof["cyrillic"], prof["cjk"], prof["latin_ext"]) == (3, 3, 2, 1)
    assert (prof["digit"], prof["space"], prof["punct"]) == (2, 5, 1)


WORDS_EN = ["the", "model", "serves", "requests", "fast", "and", "well", "with", "a", "cache", "of", "blocks"]
WORDS_RU = ["модель", "отвечает", "быстро", "и", "хорошо", "на", "запросы", "пользователей"]


def feed(mon: DriftMonitor, rng: np.random.Generator, n: int, *, shifted: bool = False, reference=False):
    """Synthetic traffic: English prompts of ~N(40, 8) words with ids in the low vocabulary and embeddings
    around 0; the shifted traffic is longer, Russian, uses other token ids, and its embeddings moved."""
    for _ in range(n):
        words = int(max(1, rng.normal(70 if shifted else 40, 8)))
        vocab = WORDS_RU if shifted else WORDS_EN
        prompt = " ".join(rng.choice(vocab, words))
        ids = rng.integers(20_000, 30_000, words) if shifted else rng.zipf(1.5, words) % 5000
        mon.observe(reference=reference, prompt=prompt, prompt_tokens=ids.tolist(),
                    output_tokens=int(rng.poisson(60 if shifted else 30)),
                    embedding=rng.normal(0.6 if shifted else 0.0, 1.0, 16))


FEATURES = ("prompt_len", "output_len", "char_classes", "token_ids", "embedding")


def test_monitor_flags_shifted_traffic_and_not_unshifted():
    rng = np.random.default_rng(3)
    mon = DriftMonitor("m", window=1000)
    feed(mon, rng, 1000)
    mon.set_reference()
    feed(mon, rng, 600)  # same distribution, other samples
    calm = mon.report()
    assert not calm["alert"], calm
    assert all(calm["features"][f]["evaluated"] for f in FEATURES)
    assert all(calm["features"][f]["psi"] < 0.1 for f in FEATURES[:4])

    feed(mon, rng, 1000, shifted=True)  # the window now holds only shifted traffic
    drift = mon.report()
    assert drift["alert"] and all(drift["features"][f]["alert"] for f in FEATURES), drift
    assert drift["features"]["prompt_len"]["ks_p"] < 1e-6


def test_too_little_data_is_not_an_alert_and_a_reference_can_be_fed():
    rng = np.random.default_rng(4)
    mon = DriftMonitor("m", DriftThresholds(min_samples=50), window=500)
    feed(mon, rng, 300, reference=True)
    feed(mon, rng, 10, shifted=True)
    rep = mon.report()
    assert not rep["alert"] and not any(f["evaluated"] for f in rep["features"].values())
    assert rep["features"]["prompt_len"]["n_live"] == 10 and rep["features"]["prompt_len"]["n_ref"] == 300


def test_running_totals_follow_the_window():
    mon = DriftMonitor("m", window=3)
    for i in range(10):
        mon.observe(prompt="a" * (i + 1), prompt_tokens=[i])
    assert mon.live.char_total.sum() == 8 + 9 + 10
    assert mon.live.token_total.sum() == 3 and list(np.nonzero(mon.live.token_total)[0]) == [7, 8, 9]


def outcomes(mon, rng, n, *, refusal=0.02, empty=0.01, length=0.1, fb=0.7, reference=False):
    for _ in range(n):
        u = rng.random()
        text = "" if u < empty else ("I'm sorry, I can't help with that." if u < empty + refusal else "Sure: ...")
        mon.observe(output=text, finish_reason="length" if rng.random() < length else "stop",
                    feedback=float(rng.random() < fb), reference=reference)


@pytest.mark.parametrize("shift,signal", [
    ({"refusal": 0.15}, "refusal_rate"),
    ({"empty": 0.1}, "empty_rate"),
    ({"fb": 0.5}, "feedback"),
    ({"length": 0.4}, "finish_reasons"),
])
def test_concept_drift_flags_each_signal_alone(shift, signal):
    from servelm.control.drift import ConceptMonitor
    rng = np.random.default_rng(5)
    mon = ConceptMonitor("m:2", window=2000)
    outcomes(mon, rng, 2000, reference=True)
    outcomes(mon, rng, 1500)
    calm = mon.report()
    assert not calm["alert"], calm
    outcomes(mon, rng, 2000, **shift)
    rep = mon.report()
    assert [k for k, v in rep["signals"].items() if v["alert"]] == [signal], rep


def test_refusal_detection():
    from servelm.control.drift import REFUSAL_RE
    assert REFUSAL_RE.match("I'm sorry, but I cannot do that")
    assert REFUSAL_RE.match("  I can't share that.")
    assert REFUSAL_RE.match("As an AI, I ...")
    assert not REFUSAL_RE.match("Sorry to hear that! Here is the fix:")
    assert not REFUSAL_RE.match("The cannot-fail path is ...")


def test_embedding_drift_is_off_when_the_embedding_model_is_a_classifier():
    """A cross-encoder in the embedding model's place gives no vectors: prompt-embedding drift is off (with a log
    line), rather than every sampled prompt counting as a failed embedding."""
    from types import SimpleNamespace

    from servelm.config.settings import load
    from servelm.control.drift_watch import DriftWatch

    cfg = load({"drift_embedding_sample": 1.0}).server
    assert DriftWatch(cfg, None, SimpleNamespace(task="classify")).embedder is None
    encoder = SimpleNamespace(task="embed")
    assert DriftWatch(cfg, None, encoder).embedder is encoder
