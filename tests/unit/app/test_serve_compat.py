"""What app/routing/serve_compat.py takes from Ray Serve's private surface, pinned (written against Ray 2.60): an
upgrade that moves any of it fails here, in one place, instead of hanging requests in the router."""
import dataclasses
import inspect
import pickle

from ray.serve._private.common import RequestMetadata
from ray.serve._private.replica import ReplicaActor
from ray.serve.request_router import LocalityMixin, PendingRequest, RequestRouter, RunningReplica

from affinity_serve.app.routing import serve_compat
from affinity_serve.app.routing.serve_router import AffinityRequestRouter


def test_the_replica_method_client_can_build_and_send_a_method_call():
    # RequestMetadata naming the method, pickled, as the replica actor's handle_request takes it
    meta = RequestMetadata(request_id="kv-feed-kv_snapshot", internal_request_id="x", call_method="kv_snapshot",
                           app_name="affinity")
    assert pickle.loads(pickle.dumps(meta)).call_method == "kv_snapshot"
    params = list(inspect.signature(ReplicaActor.handle_request).parameters)
    assert params[:2] == ["self", "pickled_request_metadata"]
    args = inspect.signature(ReplicaActor.handle_request).parameters["request_args"]
    assert args.kind is inspect.Parameter.VAR_POSITIONAL
    # RunningReplica keeps the actor handle it was built with (no public accessor)
    assert "self._actor_handle" in inspect.getsource(RunningReplica.__init__)


async def test_pending_requests_carry_the_call_arguments_and_serves_own_id():   # PendingRequest makes a Future
    fields = {f.name for f in dataclasses.fields(PendingRequest)}
    assert {"args", "kwargs", "metadata"} <= fields
    assert "internal_request_id" in {f.name for f in dataclasses.fields(RequestMetadata)}
    meta = RequestMetadata(request_id="r", internal_request_id="serve-id")
    pending = PendingRequest(args=["a"], kwargs={}, metadata=meta)
    assert serve_compat.pending_args(pending) == ("a",) and serve_compat.pending_args(None) == ()
    assert serve_compat.internal_request_id(pending) == "serve-id"


def test_the_router_hooks_it_overrides_exist_with_these_signatures():
    for name in ("initialize_state", "choose_replicas", "on_request_routed", "on_request_completed",
                 "on_replica_actor_died", "update_replicas"):
        assert callable(getattr(RequestRouter, name)), name
        assert name in AffinityRequestRouter.__dict__, name
    assert list(inspect.signature(RequestRouter.choose_replicas).parameters) == [
        "self", "candidate_replicas", "pending_request"]
    assert list(inspect.signature(RequestRouter.on_request_completed).parameters)[1:] == [
        "replica_id", "internal_request_id"]
    assert issubclass(AffinityRequestRouter, LocalityMixin)


def test_a_handle_says_whether_its_router_has_known_replicas():
    from ray.serve.handle import DeploymentHandle
    # the handle's method and its router's flag, set on the first non-empty replica set
    assert callable(DeploymentHandle.running_replicas_populated)
    from ray.serve._private.router import AsyncioRouter
    src = inspect.getsource(AsyncioRouter.update_deployment_targets)
    assert "self._running_replicas_populated = True" in src
    assert {"app_name", "deployment_name"} <= set(dir(DeploymentHandle))

    class Stub:
        def __init__(self, v):
            self.v = v

        def running_replicas_populated(self):
            return self.v
    assert serve_compat.handle_has_known_replicas(Stub(True)) is True
    assert serve_compat.handle_has_known_replicas(Stub(False)) is False
    assert serve_compat.handle_has_known_replicas(object()) is False
