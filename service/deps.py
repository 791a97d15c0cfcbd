"""What a route needs from the running app: the settings, the metrics and the models it serves."""

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from service.batcher import Batcher
from service.bundle import Bundle
from service.config import Settings
from service.errors import ServiceError
from service.metrics import Metrics
from service.tokenizer import Tokenizer


@dataclass
class ModelService:
    """One loaded bundle. `batcher` is None when the bundle loaded but its task cannot run yet."""

    bundle: Bundle
    tokenizer: Tokenizer
    batcher: Batcher | None
    execution_provider: str


@dataclass
class ServiceState:
    settings: Settings
    metrics: Metrics
    models: dict[str, ModelService] = field(default_factory=dict)  # by task: "classify", "translate"
    # task -> why it answers 503, in words safe for clients (a model name, never a filesystem path)
    unavailable: dict[str, str] = field(default_factory=dict)
    # task -> name of a configured model that could not be loaded: /readyz is 503 while any is here
    failed: dict[str, str] = field(default_factory=dict)
    # SIGTERM received: /readyz says 503 so load balancers move away, answers carry `Connection: close`
    draining: bool = False


async def get_state(request: Request) -> ServiceState:  # async: a sync dependency costs a thread hop
    return request.app.state.service


State = Annotated[ServiceState, Depends(get_state)]


def serving_model(state: ServiceState, task: str) -> ModelService:
    model = state.models.get(task)
    if model is None or model.batcher is None:
        raise ServiceError(503, "unavailable", state.unavailable.get(task, f"no {task} model is loaded"))
    return model
