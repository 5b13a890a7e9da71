"""POST /v1/feedback: a user's score or label for a served request, attached to the traffic arm (experiment,
canary window) that served it. Mounted when traffic management is on (a server with a registry)."""

from __future__ import annotations

from typing import Annotated

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from servelm.server.common import record
from servelm.server.openai.protocol import APIError

MAX_SCORE = 1e6  # scores are summed into running statistics: a bound keeps them finite
LABELS = {"positive": 1.0, "good": 1.0, "up": 1.0, "negative": 0.0, "bad": 0.0, "down": 0.0}


class FeedbackBody(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    request_id: Annotated[str, Field(min_length=1, max_length=200, description="the x-request-id of the "
                                     "response (send your own x-request-id to know it in advance)")]
    score: Annotated[float, Field(ge=-MAX_SCORE, le=MAX_SCORE)] | None = Field(
        None, description=f"a finite number within +-{MAX_SCORE:g}; higher is better")
    label: str | None = Field(None, description=f"instead of a score: {', '.join(LABELS)} (1 or 0)")


def add_routes(app: FastAPI, state) -> None:
    @app.post("/v1/feedback")
    async def feedback(body: FeedbackBody, request: Request) -> dict:
        """Only the API key that made a request may rate it, once (404 for another key, 409 a second time)."""
        if (body.score is None) == (body.label is None):
            raise APIError(400, "give exactly one of score and label", "score", "invalid_feedback")
        if body.label is not None and body.label.lower() not in LABELS:
            raise APIError(400, f"label must be one of {', '.join(LABELS)}", "label", "invalid_feedback")
        score = body.score if body.score is not None else LABELS[body.label.lower()]
        return await state.traffic.feedback(body.request_id, score, record(request).key_name)
