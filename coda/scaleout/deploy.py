"""Starting N engine replicas on Ray Serve (issue 12 item 1, 4): a local Ray instance, or a
join to an existing cluster with ``ray_address``; one Serve application per replica so the
ingress routes itself (least outstanding tokens, prefix affinity). An ingress that joins a
cluster where the replica applications already run (another ingress deployed them) uses them
as they are: several ingresses then share the replicas, and one may die (SIGKILL) without
taking the replicas with it (issue 12 item 3)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coda.engine.types import EngineConfig
from coda.scaleout.remote import RemoteEngine

if TYPE_CHECKING:
    from coda.durable.redis_log import RedisStreamLog

# NOTE: calls in flight per replica that Serve lets through (its default is 5)
MAX_ONGOING = 10_000


def start_replicas(n: int, model_dir: str | Path | None, config: EngineConfig, *,
                   ray_address: str | None = None, num_cpus: float = 1.0,
                   torch_threads: int = 1, local_cpus: int | None = None,
                   log: RedisStreamLog | None = None) -> RemoteEngine:
    """The :class:`RemoteEngine` over ``n`` replicas; ``log`` (a
    :class:`~coda.durable.redis_log.RedisStreamLog`): the replicas write the stream log."""
    import ray
    from ray import serve

    from coda.scaleout.replica import EngineReplica

    if not ray.is_initialized():
        if ray_address:
            ray.init(address=ray_address, logging_level=logging.ERROR)
        else:
            ray.init(num_cpus=local_cpus, include_dashboard=False, logging_level=logging.ERROR)
    serve.start(proxy_location="Disabled")
    running = {name for name, app in serve.status().applications.items()
               if str(app.status).endswith("RUNNING")} if ray_address else set()
    # NOTE: None reaches each replica's from_model_dir, which picks the default model itself
    path = str(model_dir) if model_dir is not None else None
    handles: list[Any] = []
    for i in range(n):
        name = f"coda-replica-{i}"
        if name in running:
            handles.append(serve.get_app_handle(name))
            continue
        # NOTE: Serve admits only 5 calls per replica by default (queueing the rest at the
        # caller); the engine has its own admission queue and the ingress routes, so a
        # replica takes every call it is sent
        # NOTE: the decorator form (options, then the class): typed as a Deployment by Ray
        dep = serve.deployment(name="replica", num_replicas=1,
                               max_ongoing_requests=MAX_ONGOING,
                               ray_actor_options={"num_cpus": num_cpus})(EngineReplica)
        handles.append(serve.run(dep.bind(path, config, torch_threads), name=name,
                                 route_prefix=None))
    engine = RemoteEngine(handles, config, log=log)
    engine.owns_replicas = len(running) == 0
    return engine


def stop_replicas(engine: RemoteEngine | None = None) -> None:
    """Delete the replica applications (unless ``engine`` joined ones it did not deploy)."""
    from ray import serve

    if engine is None or engine.owns_replicas:
        serve.shutdown()
