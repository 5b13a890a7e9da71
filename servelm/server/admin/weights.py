"""POST /update_weights_from_disk (admin key; SGLang's route, which reinforcement-learning trainers call between
rollouts): a model's engine copies a checkpoint's weights into its running model in place, between steps. The
engine process reads the files; this process only asks and answers."""

from __future__ import annotations

from typing import Annotated

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from servelm.server.admin.kv import ask_engine, single_engine
from servelm.server.openai.protocol import APIError


class UpdateWeightsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: Annotated[str, Field(min_length=1, max_length=4096)] = Field(
        description="a Hugging Face folder or a GGUF file on the server's machine, of the running model's "
                    "architecture, shapes and settings")
    model: Annotated[str, Field(min_length=1)] | None = Field(
        None, description="the served model to update (default: the default model)")


class UpdateWeightsOut(BaseModel):
    success: bool = Field(True, description="as SGLang's answer; a refusal is an HTTP error instead")
    message: str
    model: str
    num_bytes: int = Field(description="bytes of weights copied")


def add_weight_routes(app: FastAPI, state) -> None:
    @app.post("/update_weights_from_disk", response_model=UpdateWeightsOut,
              responses={409: {"description": "requests in flight"},
                         400: {"description": "the checkpoint is not the running model's shapes and settings"}})
    async def update_weights_from_disk(body: UpdateWeightsBody):
        """Copy a checkpoint's weights into the model's engine in place and empty its prefix cache, as
        SGLang's route: after a training step. 409 while requests are in flight, 400 for a checkpoint of other
        shapes or settings; either way nothing changes. A restarted engine loads the new checkpoint."""
        served = single_engine(state, body.model, "update a single engine's weights", "invalid_weights_request",
                               needs="update_weights_from_disk")
        copied = await ask_engine(lambda: served.engine.update_weights_from_disk(body.model_path),
                                  "invalid_weights_request", "model_path")
        if copied is None:
            raise APIError(409, "requests are in flight: weights are updated only while the engine is idle",
                           code="engine_busy")
        return UpdateWeightsOut(message=f"weights updated from {body.model_path}", model=served.served_name,
                                num_bytes=copied)
