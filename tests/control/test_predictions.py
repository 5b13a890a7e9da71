"""Prediction log (servelm/control/predictions.py): durability across kill -9, modes, redaction,
append-only, GDPR erasure, retention, the JSON-lines sink."""

import asyncio
import json
import signal
import subprocess
import sys
import textwrap

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DatabaseError

from servelm.control import db
from servelm.control.errors import ControlError, InvalidRequest
from servelm.control.predictions import Prediction, PredictionLog, Redactor

DAY = 86400.0


def open_log(tmp_path, **kw) -> PredictionLog:
    return PredictionLog(db.open_engine(db.default_url(tmp_path)), **kw)


def open_log_at(url: str, **kw) -> PredictionLog:
    return PredictionLog(db.open_engine(url), **kw)


WRITER = textwrap.dedent("""
    import asyncio, os, signal, sys, time
    from pathlib import Path
    from servelm.control import db
    from servelm.control.predictions import Prediction, PredictionLog

    # a slow disk: each commit starts 20 ms late, so an entry acknowledged before its commit is lost
    _flush = PredictionLog._flush
    PredictionLog._flush = lambda self, rows: (time.sleep(0.02), _flush(self, rows))[1]

    async def main():
        log = PredictionLog(db.open_engine(db.default_url(Path(sys.argv[1]))), default_mode="full")

        def entry(i):
            return Prediction(request_id=f"req-{i}", model="m", version=1, user=f"u{i % 3}",
                              prompt="p" * 200, output="o" * 500, completion_tokens=5)
        for i in range(30):  # one at a time, then 10 concurrent ones
            await log.log(entry(i))
            print(f"req-{i}", flush=True)  # the "response": only after log() returned
        await asyncio.gather(*(log.log(entry(i)) for i in range(30, 40)))
        print(*(f"req-{i}" for i in range(30, 40)), sep="\\n", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # right after the last log() returned

    asyncio.run(main())
""")


def test_every_logged_entry_survives_kill_9_of_the_writer(tmp_path):
    proc = subprocess.run([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                          timeout=120)
    answered = proc.stdout.split()
    assert proc.returncode == -signal.SIGKILL and answered == [f"req-{i}" for i in range(40)]
    logged = [e["request_id"] for e in open_log(tmp_path).entries()]
    assert sorted(logged) == sorted(answered)  # none lost


def test_modes_off_metadata_full(tmp_path):
    log = open_log(tmp_path, modes={"secret": "off", "open": "full"}, default_mode="metadata")
    p = dict(prompt="hi, mail me at a.b@example.com", output="sure", prompt_tokens=7, completion_tokens=2,
             latency_s=0.5, ttft_s=0.1, finish_reason="stop", key_name="k1", user="u", arm="v1", version=3)
    assert asyncio.run(log.log(Prediction(request_id="r0", model="secret", **p))) is False
    assert asyncio.run(log.log(Prediction(request_id="r1", model="meta", **p)))
    assert asyncio.run(log.log(Prediction(request_id="r2", model="open", **p)))
    rows = {e["request_id"]: e for e in log.entries()}
    assert set(rows) == {"r1", "r2"}
    assert rows["r1"]["prompt"] is None and rows["r1"]["output"] is None and rows["r1"]["prompt_tokens"] == 7
    assert rows["r2"]["prompt"] == "hi, mail me at [EMAIL]" and rows["r2"]["output"] == "sure"
    assert (rows["r2"]["version"], rows["r2"]["arm"], rows["r2"]["key_name"], rows["r2"]["finish_reason"]) == (
        3, "v1", "k1", "stop")
    with pytest.raises(ControlError):
        log.set_mode("m", "everything")


@pytest.mark.parametrize("raw,want", [
    ("write to jane.doe+x@mail.example.co.uk now", "write to [EMAIL] now"),
    ("card 4111 1111 1111 1111 ok", "card [CARD] ok"),
    ("card 5500-0000-0000-0004.", "card [CARD]."),
    ("order 1234 5678 9012 3456 (not a valid card)", "order 1234 5678 9012 3456 (not a valid card)"),
    ("call +44 20 7946 0958 or (415) 555-2671", "call [PHONE] or [PHONE]"),
    ("on 2024-01-15 at 10:30, ticket 12345", "on 2024-01-15 at 10:30, ticket 12345"),
])
def test_builtin_redaction(raw, want):
    assert Redactor()(raw) == want


def test_custom_redaction_rules_and_bad_ones(tmp_path):
    r = Redactor(["email", {"name": "ticket", "pattern": r"ACME-\d+", "replace": "[TICKET]"}])
    assert r("ACME-991 from x@y.io, tel 415-555-2671") == "[TICKET] from [EMAIL], tel 415-555-2671"
    for bad in ["nope", {"pattern": "("}, {"name": "no pattern"}]:
        with pytest.raises(ControlError) as e:
            Redactor([bad])
        assert isinstance(e.value, InvalidRequest)
    log = open_log(tmp_path, default_mode="full", redactor=r)
    log.write(Prediction(request_id="r", model="m", prompt="ACME-7", output="ok", error="bad ACME-7"))
    (e,) = log.entries()
    assert (e["prompt"], e["error"]) == ("[TICKET]", "bad [TICKET]")


def test_log_is_append_only(tmp_path, database_url):
    log = open_log_at(database_url)
    log.write(Prediction(request_id="r", model="m"))
    with pytest.raises(DatabaseError, match="append-only"), db.write(log.engine) as conn:
        conn.execute(text("UPDATE predictions SET model = 'x'"))
    assert log.entries()[0]["model"] == "m"


def test_erasure_removes_exactly_one_users_entries_also_from_the_file(tmp_path, database_url):
    sink = tmp_path / "predictions.jsonl"
    log = open_log_at(database_url, sink=sink, default_mode="full")
    for i in range(30):
        log.write(Prediction(request_id=f"r{i}", model="m", user=["alice", "bob", "carol"][i % 3], prompt=f"p{i}"))
    log.write(Prediction(request_id="anon", model="m"))
    before = {u: len(log.entries(user=u)) for u in ("alice", "carol")}
    assert log.erase_user("bob") == 10
    assert log.entries(user="bob") == [] and {u: len(log.entries(user=u)) for u in ("alice", "carol")} == before
    assert len(log.entries()) == 21
    lines = [json.loads(x) for x in sink.read_text().splitlines()]
    assert len(lines) == 21 and not any(x["user"] == "bob" for x in lines)
    assert log.erase_user("bob") == 0


def test_retention_per_model_and_default(tmp_path, database_url):
    now = 1_000_000_000.0
    log = open_log_at(database_url, retention_days={"short": 1}, default_retention_days=30, clock=lambda: now)
    for model in ("short", "other"):
        for age_days in (0.5, 2, 40):
            log.write(Prediction(request_id=f"{model}-{age_days}", model=model, at=now - age_days * DAY))
    assert log.purge_expired() == {"short": 2, "*": 1}
    assert sorted(e["request_id"] for e in log.entries()) == ["other-0.5", "other-2", "short-0.5"]
    assert log.purge(0.1) == 3 and log.entries() == []


def test_file_only_sink(tmp_path):
    sink = tmp_path / "p.jsonl"
    log = PredictionLog(None, sink=sink, default_mode="full", clock=lambda: 5.0)
    assert asyncio.run(log.log(Prediction(request_id="a", model="m", user="u", output="x@y.io")))
    log.write(Prediction(request_id="b", model="m", user="v"))
    assert [e["request_id"] for e in log.entries()] == ["a", "b"]
    assert json.loads(sink.read_text().splitlines()[0])["output"] == "[EMAIL]"
    assert log.erase_user("u") == 1 and [e["request_id"] for e in log.entries()] == ["b"]
    with pytest.raises(ControlError):
        PredictionLog(None)


def test_group_commit_batches_waiting_entries_and_reports_failures():
    import threading

    from servelm.control.predictions import _GroupWriter
    batches, entered, release = [], threading.Event(), threading.Event()

    def flush(rows):
        entered.set()
        release.wait()
        if any(r.get("fail") for r in rows):
            raise OSError("disk full")
        batches.append([r["i"] for r in rows])

    w = _GroupWriter(flush)
    first = w.submit({"i": 0})
    entered.wait()  # the writer is inside the first transaction: the next ones wait and go together
    rest = [w.submit({"i": i}) for i in range(1, 200)]
    assert not first.done() and not any(f.done() for f in rest)  # nothing is reported before it is durable
    release.set()
    assert first.result() and all(f.result() for f in rest)
    assert batches == [[0], list(range(1, 200))]
    bad = [w.submit({"i": -1, "fail": True})]
    with pytest.raises(OSError):
        bad[0].result()
    w.close()


def test_concurrent_logs_are_all_written(database_url):
    log = open_log_at(database_url)

    async def many():
        return await asyncio.gather(*(log.log(Prediction(request_id=f"r{i}", model="m")) for i in range(100)))
    assert all(asyncio.run(many()))
    assert sorted(e["request_id"] for e in log.entries()) == sorted(f"r{i}" for i in range(100))
    log.close()
