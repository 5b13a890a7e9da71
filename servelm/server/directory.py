"""The models this server answers for, by the name clients put in `model`.

`ModelDirectory.resolve(model)` returns the `ServedModel` that serves a request: the engine surface the HTTP
layer uses (an AsyncEngine, or a control-plane Deployment of several workers) plus its tokenizer, the name
responses carry and the registered version, if any. Models come from two places: fixed ones given at start
(`servelm serve MODEL`, or the config file's `models:` list), and, when a deployment manager is attached,
whatever it has deployed (`name` -> its PRODUCTION version, `name:version` pinned).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from servelm.control.errors import ControlError, NotFound
from servelm.control.types import Kind, ModelVersion
from servelm.server.errors import control_api_error
from servelm.server.openai.protocol import APIError
from servelm.worker.engine_client import EngineClient


class ServedModel:
    """One servable target. Attributes it does not have itself (generate, abort, max_model_len, info,
    check_engine, num_queued, live_counts, stats, ...) are the engine's."""

    def __init__(self, engine: EngineClient, tokenizer: Any, served_name: str, version: ModelVersion | None = None,
                 metrics: Any = None, lease: Any = None) -> None:
        self.engine = engine  # a pinned deployment's lease (control/lease.py), or the engine itself
        self.tokenizer = tokenizer
        self.served_name = served_name  # what responses' `model` says: the name, or name:version
        self.version = version
        self.metrics = metrics  # this model's labelled metrics view, where the server keeps one
        self.decision: Any = None  # the traffic policy's decision that picked this version, if one did
        self.lease = lease  # a request's pin on a deployment's generation, released when the request ends
        self.lora: str | None = None  # a LoRA adapter's name: requests run with it on the base's engine
        self.base: str | None = None  # with `lora`: the served name of the base model

    def release(self) -> None:
        """End the request's hold on what serves it (nothing for a fixed model); idempotent."""
        if self.lease is not None:
            self.lease.release()

    @property
    def name(self) -> str:
        """The model's name without a version."""
        return self.version.name if self.version is not None else self.served_name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.engine, attr)

    def __repr__(self) -> str:
        return f"ServedModel({self.served_name!r})"


class ModelDirectory:
    """Resolves a request's `model` field to the model that serves it."""

    def __init__(self, metrics_for: Callable[[str], Any] | None = None) -> None:
        self._fixed: dict[str, ServedModel] = {}
        self._aliases: dict[str, str] = {}  # another name a request may use -> the fixed model's name
        self.embedding_name: str | None = None  # the server's own embedding model (served beside the directory)
        self.deployments: Any = None  # control.deployments.DeploymentManager, when the server has one
        # model -> (deployment, seconds waited): load a registered version no deployment serves yet, on its
        # first request (None: off)
        self.on_demand: Callable[[str, Kind], Awaitable[tuple[Any, float]]] | None = None
        # name -> that model's metrics view. A deployment's request figures go there; its workers' step
        # figures do not (several workers' cumulative counters cannot feed one series).
        self.metrics_for = metrics_for
        self._metrics: dict[str, Any] = {}  # served name -> metrics of deployed versions
        # LoRA adapter name -> (the base model's name, the adapter's path): a request naming the adapter runs on
        # the base's engine with it (the engine holds it: --lora-modules, or loaded through the admin API)
        self.adapters: dict[str, tuple[str, str]] = {}

    def add(self, served: ServedModel, aliases: tuple[str, ...] = ()) -> None:
        """A model served for the server's whole life under its name, and under `aliases` (--served-model-name's
        further names: a request may name any, responses carry the first)."""
        for name in (served.served_name, *aliases):
            if name in self._fixed or name in self._aliases:
                raise ValueError(f"two models are named {name!r}")
        self._fixed[served.served_name] = served
        self._aliases.update(dict.fromkeys(aliases, served.served_name))

    def add_adapter(self, name: str, base: str, path: str) -> None:
        if name in self._fixed or name in self._aliases:
            raise ValueError(f"adapter {name!r} has the name of a model")
        self.adapters[name] = (base, path)

    def aliases(self, name: str) -> list[str]:
        """The other names a fixed model answers to."""
        return [a for a, target in self._aliases.items() if target == name]

    def canonical(self, model: str | None) -> str | None:
        """The name a fixed model's alias stands for; any other name as it is."""
        return self._aliases.get(model, model) if model is not None else None

    @property
    def default(self) -> ServedModel | None:
        """The model a request that names none gets: the first fixed one."""
        return next(iter(self._fixed.values()), None)

    def fixed(self) -> list[ServedModel]:
        return list(self._fixed.values())

    def _wrap(self, dep: Any, pin: bool = False) -> ServedModel:
        """A deployment as a ServedModel, as it is now (a swap changes its version and tokenizer), with the
        metrics of its current version. With `pin`, a request's lease on its current generation (taken in the
        same step as the resolution): tokenizer, version and workers stay that generation's; `dep` may be a
        lease already (an on-demand load takes it)."""
        lease = dep if hasattr(dep, "release") else dep.pin() if pin and hasattr(dep, "pin") else None
        target = lease if lease is not None else dep
        version = target.version
        metrics = None
        if self.metrics_for is not None and _kind(target) == Kind.GENERATE:
            metrics = self._metrics.get(version.ref)
            if metrics is None:
                metrics = self._metrics[version.ref] = self.metrics_for(version.ref)
        return ServedModel(target, getattr(target, "tokenizer", None), version.ref, version, metrics, lease)

    def deployed(self, kind: Kind = Kind.GENERATE) -> list[ServedModel]:
        """The attached manager's deployments of one kind (generation, or embedding), wrapped."""
        if self.deployments is None:
            return []
        return [self._wrap(d) for d in self.deployments.list() if _kind(d) == kind]

    def __iter__(self) -> Iterator[ServedModel]:
        """Every generation model: the fixed ones, then the deployed versions."""
        yield from self.fixed()
        yield from self.deployed()

    def names(self, kind: Kind = Kind.GENERATE) -> list[str]:
        """Every id a request may put in `model`: fixed names and their aliases (generation; embedding: the
        server's own embedding model), and each deployed version's name and name:version."""
        if kind == Kind.GENERATE:
            out = [n for name in self._fixed for n in (name, *self.aliases(name))] + list(self.adapters)
        else:
            out = [self.embedding_name] if self.embedding_name is not None else []
        for d in self.deployed(kind):
            for n in (d.name, d.served_name):
                if n not in out:
                    out.append(n)
        return out

    def resolve(self, model: str | None, kind: Kind = Kind.GENERATE, attrs: Any = None,
                pin: bool = False) -> ServedModel:
        """The model serving `model` (None: the default one); 404 in OpenAI's shape naming what exists. With
        the request's attributes (control.traffic.RequestAttrs), a bare name's traffic policy picks the
        version (DeploymentManager.route); its decision is on the result. With `pin`, a deployment's result
        holds a lease on the generation it resolved (the caller must `release()` it when the request ends)."""
        if model is None and kind == Kind.GENERATE:
            if self.default is not None:
                return self.default
            deployed = [d for d in self.deployments.list() if _kind(d) == kind] if self.deployments is not None else []
            if len(deployed) == 1:
                return self._wrap(deployed[0], pin)
            if not self.names(kind) and self.names(Kind.EMBED):
                raise self._embeds_only(self.names(Kind.EMBED)[0])
            raise APIError(400, f"name a model: this server serves {self._listing(kind)}", "model",
                           "model_required")
        found = self._fixed.get(self.canonical(model)) if kind == Kind.GENERATE else None
        if found is not None:
            return found
        if kind == Kind.GENERATE and model in self.adapters:
            base = self.resolve(self.adapters[model][0], kind, attrs, pin)
            served = ServedModel(base.engine, base.tokenizer, model, base.version, base.metrics, base.lease)
            served.lora, served.base = model, base.served_name
            return served
        if self.deployments is not None and model is not None:
            try:
                if attrs is not None and kind == Kind.GENERATE:
                    dep, decision = self.deployments.route(model, attrs)
                else:
                    dep, decision = self.deployments.resolve(model), None
            except NotFound:
                pass  # answered below with the listing of what exists
            except ControlError as e:
                raise control_api_error(e, "model") from e
            else:
                if _kind(dep) == kind:
                    served = self._wrap(dep, pin)
                    served.decision = decision
                    return served
        raise self._not_found(model, kind)

    async def load(self, model: str | None, kind: Kind = Kind.GENERATE, attrs: Any = None
                   ) -> tuple[ServedModel, float | None]:
        """As `resolve` for a request (pinned: release the result when the request ends), but a registered
        version that no deployment serves yet is loaded first when on-demand loading is on: returns the model
        and the seconds waited for its load (None: it was there)."""
        try:
            return self.resolve(model, kind, attrs, pin=True), None
        except APIError as e:
            if e.status != 404 or model is None or self.on_demand is None:
                raise
            try:
                dep, waited = await self.on_demand(model, kind)
            except NotFound:
                raise e from None  # nothing registered either: the listing of what exists stands
            except ControlError as ce:
                raise control_api_error(ce, "model") from ce
            if _kind(dep) != kind:
                if hasattr(dep, "release"):
                    dep.release()
                raise e from None
            return self._wrap(dep, pin=True), waited

    def _embeds_only(self, model: str) -> APIError:
        """A generation request for an embedding model (vLLM answers its pooling runner's the same way)."""
        names = self.names(Kind.GENERATE)
        others = (f"generation models here: {self._listing(Kind.GENERATE)}" if names
                  else "this server has no generation model")
        return APIError(400, f"model {model!r} is an embedding model: it answers /v1/embeddings, /v1/score, "
                             f"/v1/rerank and /classify, not generation requests; {others}", "model",
                        "model_not_supported")

    def _not_found(self, model: str | None, kind: Kind) -> APIError:
        if kind == Kind.GENERATE and model is not None and model in self.names(Kind.EMBED):
            return self._embeds_only(model)
        if kind == Kind.EMBED:
            return APIError(404, f"model {model!r} does not exist or is not an embedding model; embedding "
                                 f"models: {self._listing(kind)}", "model", "model_not_found")
        return APIError(404, f"model {model!r} does not exist; this server serves {self._listing(kind)}", "model",
                        "model_not_found")

    def _listing(self, kind: Kind = Kind.GENERATE) -> str:
        names = self.names(kind)
        return ", ".join(repr(n) for n in names) if names else "no models yet"


def _kind(dep: Any) -> Kind:
    """The kind of requests a deployment answers (a LoRA adapter's: generation)."""
    return getattr(dep.version, "kind", Kind.GENERATE).serves
