"""The prediction log: one entry per served request, durable before the response completes.

Entries go to a `predictions` table in the registry's database (SQLite by default, in WAL mode with the
default synchronous=FULL, so a committed entry survives a kill -9 and a power cut) and/or to a JSON-lines
file, and optionally also to an OTLP log exporter (prediction_otlp.py; asynchronous, not part of durability). `log()` returns only after the entry is committed (and, for the file, flushed and fsynced): a caller
that awaits it before completing the response loses no answered request (RPO 0). Writes run on one writer
thread (the event loop never waits on the disk) with group commit: entries that arrive while a commit is
in progress go together in the next short transaction, so concurrent requests share one fsync.

Per model the mode is off, metadata (no prompt/output) or full. Redaction rules (e-mail, phone, card numbers
with a Luhn check, custom regexes) run before anything is written. The log is append-only (a trigger refuses
UPDATE, on SQLite and PostgreSQL); rows leave it only through retention (`purge*`) and GDPR erasure
(`erase_user`), whose caller writes the audit entry (without the erased content).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Column,
    Engine,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    delete,
    select,
)
from sqlalchemy.exc import IntegrityError

from servelm.control import db, schema
from servelm.control.errors import InvalidRequest

logger = logging.getLogger("servelm.traffic")
MODES = ("off", "metadata", "full")
DAY = 86400.0

metadata = MetaData()
predictions_table = Table(
    "predictions", metadata,
    Column("seq", Integer, primary_key=True, autoincrement=True),
    Column("request_id", String(200), nullable=False),
    Column("at", Float, nullable=False, index=True),
    Column("model", String(128), nullable=False),
    Column("version", Integer),
    Column("arm", String(200)),
    Column("key_name", String(200)),
    Column("user", String(200), index=True),
    Column("prompt", Text),
    Column("output", Text),
    Column("prompt_tokens", Integer, nullable=False),
    Column("completion_tokens", Integer, nullable=False),
    Column("latency_s", Float),
    Column("ttft_s", Float),
    Column("finish_reason", String(32)),
    Column("error", Text),
)
Index("predictions_model_at", predictions_table.c.model, predictions_table.c.at)
Index("predictions_request_id", predictions_table.c.request_id)
# one row per rated request: feedback is accepted once per request, across restarts too
feedback_table = Table(
    "feedback", metadata,
    Column("request_id", String(200), primary_key=True),
    Column("at", Float, nullable=False),
    Column("score", Float, nullable=False),
)
# UPDATE is refused by a trigger the first migration creates (SQLite and PostgreSQL)


@dataclass
class Prediction:
    """One served request as the log records it (`at` is set when logged, if not given)."""

    request_id: str
    model: str
    version: int | None = None
    arm: str | None = None
    key_name: str | None = None
    user: str | None = None
    prompt: str | None = None
    output: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float | None = None
    ttft_s: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    at: float | None = None


def _luhn(digits: str) -> bool:
    total, alt = 0, False
    for ch in reversed(digits):
        d = int(ch)
        if alt:
            d = d * 2 - 9 if d > 4 else d * 2
        total, alt = total + d, not alt
    return total % 10 == 0


def _card(m: re.Match) -> str:
    digits = re.sub(r"\D", "", m.group(0))
    return "[CARD]" if 13 <= len(digits) <= 19 and _luhn(digits) else m.group(0)


BUILTIN_RULES: dict[str, tuple[str, str | Callable[[re.Match], str]]] = {
    "email": (r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}", "[EMAIL]"),
    # 13-19 digits, optionally grouped by spaces/dashes; only Luhn-valid numbers are replaced
    "card": (r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])", _card),
    # international (+ and 8-15 digits) or North-American style 3-3-4; dates (4-2-2) do not match
    "phone": (r"(?<![\w+])(?:\+\d(?:[ .()-]*\d){7,14}|\(?\d{3}\)?[ .-]?\d{3}[ .-]\d{4})(?!\w)", "[PHONE]"),
}


class Redactor:
    """Applies rules in order (cards before phones, so a card number is not taken for a phone number)."""

    def __init__(self, rules: Iterable[str | dict] = ("email", "card", "phone")) -> None:
        self.rules: list[tuple[str, re.Pattern, str | Callable[[re.Match], str]]] = []
        for r in rules:
            if isinstance(r, str):
                if r not in BUILTIN_RULES:
                    raise InvalidRequest(f"unknown redaction rule {r!r}; built in: {', '.join(BUILTIN_RULES)}",
                                         code="invalid_redaction", param="redaction")
                pattern, repl = BUILTIN_RULES[r]
                self.rules.append((r, re.compile(pattern), repl))
                continue
            try:
                self.rules.append((r.get("name", "custom"), re.compile(r["pattern"]), r.get("replace", "[REDACTED]")))
            except (KeyError, TypeError, AttributeError, re.error) as e:
                raise InvalidRequest(f"bad custom redaction rule {r!r}: {e}", code="invalid_redaction",
                                     param="redaction") from None

    def __call__(self, text: str | None) -> str | None:
        if not text:
            return text
        for _, pattern, repl in self.rules:
            text = pattern.sub(repl, text)
        return text


class PredictionLog:
    """The log. `engine` is the registry's database (None: the JSON-lines `sink` only)."""

    def __init__(self, engine: Engine | None, *, sink: Path | None = None, modes: dict[str, str] | None = None,
                 default_mode: str = "metadata", redactor: Redactor | None = None,
                 retention_days: dict[str, float] | None = None, default_retention_days: float | None = None,
                 clock: Callable[[], float] = time.time, otlp: Any = None) -> None:
        if engine is None and sink is None:
            raise InvalidRequest("a prediction log needs a database or a file", code="invalid_config")
        self.engine, self.sink, self.clock = engine, Path(sink) if sink else None, clock
        self.otlp = otlp  # prediction_otlp.OtlpSink: each entry also exported as an OTLP log record
        self.modes: dict[str, str] = {}
        for model, mode in (modes or {}).items():
            self.set_mode(model, mode)
        self.default_mode = _check_mode(default_mode)
        self.redactor = redactor if redactor is not None else Redactor()
        self.retention_days = dict(retention_days or {})
        self.default_retention_days = default_retention_days
        self._sink_lock = threading.Lock()
        self._writer: _GroupWriter | None = None
        self._writer_lock = threading.Lock()
        if engine is not None:
            schema.ensure(engine)

    def mode(self, model: str) -> str:
        return self.modes.get(model, self.default_mode)

    def set_mode(self, model: str, mode: str) -> None:
        self.modes[model] = _check_mode(mode)

    def _row(self, p: Prediction) -> dict:
        row = dataclasses.asdict(p)
        row["at"] = p.at if p.at is not None else self.clock()
        if self.mode(p.model) == "full":
            row["prompt"], row["output"] = self.redactor(p.prompt), self.redactor(p.output)
        else:
            row["prompt"] = row["output"] = None
        row["error"] = self.redactor(p.error)
        return row

    def _flush(self, rows: list[dict]) -> None:
        """Make `rows` durable: one transaction, then one fsync of the file."""
        if self.engine is not None:
            with db.write(self.engine, exclusive=False) as conn:
                conn.execute(predictions_table.insert(), rows)
        if self.sink is not None:
            text = "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in rows)
            with self._sink_lock, open(self.sink, "a", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        if self.otlp is not None:
            try:
                self.otlp.export(rows)  # queued for a background export: never delays the response
            except Exception:
                logger.exception("exporting prediction-log entries over OTLP failed")

    def write(self, p: Prediction) -> bool:
        """Record `p` now, in the calling thread, and return once it is durable; False when the model's mode
        is off."""
        if self.mode(p.model) == "off":
            return False
        self._flush([self._row(p)])
        return True

    async def log(self, p: Prediction) -> bool:
        """Record `p` through the group-committing writer thread and return once it is durable; await it
        before completing the response. False when the model's mode is off."""
        if self.mode(p.model) == "off":
            return False
        row = self._row(p)
        with self._writer_lock:
            if self._writer is None:
                self._writer = _GroupWriter(self._flush)
            fut = self._writer.submit(row)
        return await asyncio.wrap_future(fut)

    def close(self) -> None:
        """Stop the writer thread after what was submitted is written."""
        with self._writer_lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        if self.otlp is not None:
            self.otlp.close()

    def entries(self, *, user: str | None = None, model: str | None = None, since: float | None = None,
                limit: int | None = None) -> list[dict]:
        """Entries in the order they were logged (from the database, else the file)."""
        if self.engine is None:
            rows = self._sink_rows()
            return [r for r in rows if (user is None or r.get("user") == user)
                    and (model is None or r.get("model") == model)
                    and (since is None or r["at"] >= since)][:limit]
        q = select(predictions_table).order_by(predictions_table.c.seq)
        if user is not None:
            q = q.where(predictions_table.c.user == user)
        if model is not None:
            q = q.where(predictions_table.c.model == model)
        if since is not None:
            q = q.where(predictions_table.c.at >= since)
        if limit is not None:
            q = q.limit(limit)
        with db.read(self.engine) as conn:
            return [dict(r._mapping) for r in conn.execute(q)]

    def find(self, request_id: str) -> dict | None:
        """The entry of `request_id` (None when the log has none: its mode was off, it was purged or erased),
        with `rated`: whether feedback for it was recorded. From the database only (the file is not indexed)."""
        if self.engine is None:
            return None
        with db.read(self.engine) as conn:
            row = conn.execute(select(predictions_table).where(predictions_table.c.request_id == request_id)
                               .limit(1)).first()
            if row is None:
                return None
            rated = conn.execute(select(feedback_table.c.request_id)
                                 .where(feedback_table.c.request_id == request_id)).first() is not None
        return {**row._mapping, "rated": rated}

    def record_feedback(self, request_id: str, score: float) -> bool:
        """Mark `request_id` as rated; False when it already was (the database decides, so two servers
        or a restart cannot both accept it). True without a database (the caller's memory decides)."""
        if self.engine is None:
            return True
        try:
            with db.write(self.engine, exclusive=False) as conn:
                conn.execute(feedback_table.insert(), {"request_id": request_id, "at": self.clock(), "score": score})
        except IntegrityError:
            return False
        return True

    def erase_user(self, user: str) -> int:
        """GDPR erasure: remove every entry of `user` (database and file); the number removed (from the
        database when there is one). Audit it with the user id and the count, never the content."""
        removed = self._sink_rewrite(lambda r: r.get("user") == user)
        if self.engine is not None:
            with db.write(self.engine, exclusive=False) as conn:
                removed = conn.execute(delete(predictions_table).where(predictions_table.c.user == user)).rowcount
        return removed

    def purge(self, older_than_days: float, model: str | None = None, now: float | None = None) -> int:
        """Delete entries older than the given age (of one model, or all); how many were deleted."""
        cutoff = (self.clock() if now is None else now) - older_than_days * DAY
        return self._delete_where(lambda r: r["at"] < cutoff and (model is None or r.get("model") == model),
                                  cutoff, [model] if model is not None else None, False)

    def purge_expired(self, now: float | None = None) -> dict[str, int]:
        """Apply retention: each listed model's own number of days, the default for the others. Run it
        from a periodic background job; returns counts per model (`*` for the default)."""
        now = self.clock() if now is None else now
        out = {m: self.purge(days, m, now) for m, days in self.retention_days.items()}
        if self.default_retention_days is not None:
            cutoff = now - self.default_retention_days * DAY
            listed = list(self.retention_days)
            out["*"] = self._delete_where(lambda r: r["at"] < cutoff and r.get("model") not in listed,
                                          cutoff, listed, True)
        return out

    def _delete_where(self, match: Callable[[dict], bool], cutoff: float, models: list[str] | None,
                      exclude: bool) -> int:
        removed = self._sink_rewrite(match)
        if self.engine is None:
            return removed
        stmt = delete(predictions_table).where(predictions_table.c.at < cutoff)
        if models is not None:
            col = predictions_table.c.model
            stmt = stmt.where(col.not_in(models) if exclude else col.in_(models))
        with db.write(self.engine, exclusive=False) as conn:
            return conn.execute(stmt).rowcount

    def _sink_rows(self) -> list[dict]:
        if self.sink is None or not self.sink.exists():
            return []
        with open(self.sink, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    def _sink_rewrite(self, drop: Callable[[dict], bool]) -> int:
        """Rewrite the file without the matching lines (atomically: a new file renamed over the old)."""
        if self.sink is None:
            return 0
        with self._sink_lock:
            rows = self._sink_rows()
            keep = [r for r in rows if not drop(r)]
            if len(keep) == len(rows):
                return 0
            tmp = self.sink.with_name(self.sink.name + ".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in keep)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.sink)
            return len(rows) - len(keep)


class _GroupWriter:
    """One thread that writes what was submitted, in batches: each batch is one `flush` call (one
    transaction), and every submitter's future resolves only after its batch is durable."""

    def __init__(self, flush: Callable[[list[dict]], None], max_batch: int = 256) -> None:
        self._flush, self._max = flush, max_batch
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="servelm-prediction-log", daemon=True)
        self._thread.start()

    def submit(self, row: dict) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put((row, fut))
        return fut

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < self._max:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._q.put(None)  # stop after this batch
                    break
                batch.append(nxt)
            try:
                self._flush([row for row, _ in batch])
            except BaseException as e:  # every waiter learns that its entry was not written
                for _, fut in batch:
                    fut.set_exception(e)
            else:
                for _, fut in batch:
                    fut.set_result(True)


def _check_mode(mode: str) -> str:
    if mode not in MODES:
        raise InvalidRequest(f"prediction log mode must be one of {', '.join(MODES)}, not {mode!r}",
                             code="invalid_mode", param="mode")
    return mode
