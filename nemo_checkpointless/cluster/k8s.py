"""launcher.target=k8s: a Kubeflow `PyTorchJob` (one pod per node) and the job's store (a Deployment + Service).

Built from the Kubeflow training SDK's models (`kubeflow-training`: `KubeflowOrgV1PyTorchJob`, ...) around the
Kubernetes Python client's (`V1PodTemplateSpec`, ...), both imported lazily (the `cluster` extra).

- `store.yaml`: a Deployment of one `checkpointless-store --host 0.0.0.0 --port 29400` (Recreate: never two
  stores; rescheduled if its node goes) and a Service `NAME-store` on port 29400.
- `pytorchjob.yaml`: replicas Master (1) + Worker (num_nodes + spare_nodes - 1), all with the same pod: the training
  operator sets `PET_NODE_RANK` (Master 0, Worker i: i + 1) when the job has a Master, and the agent's arguments
  take it by Kubernetes' `$(PET_NODE_RANK)` expansion. `restartPolicy: Never`: a node's agent cannot come back
  under its node rank (its claim stays in the store; the leader recovers a lost node's ranks on the others), so a
  restarted pod would only fail at joining. The operator marks the PyTorchJob Failed at the first agent that fails,
  and with the default cleanPodPolicy (None) the other pods train on; it marks it Succeeded when the Master (node
  0's agent) exits 0, and leaves the other pods to finish.
- Every pod: `/dev/shm` a memory `emptyDir` sized by `job.shm_size`, `nvidia.com/gpu: trainer.devices` with
  trainer.accelerator=gpu, `job.rank_env`, and an init container that waits (up to launcher.start_timeout_s) for the
  store to accept connections.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nemo_checkpointless.cluster import job
from nemo_checkpointless.config import Config
from nemo_checkpointless.errors import ConfigError

NODE_RANK_ENV = "PET_NODE_RANK"  # set by the training operator (pkg/controller.v1/pytorch/envvar.go)
CONTAINER = "pytorch"  # the operator's webhook requires one container of this name
OPERATOR_PORT_NAME, OPERATOR_PORT = "pytorchjob-port", 23456  # what its defaulting adds (MASTER_PORT); unused here
RESTART_POLICY = "Never"  # see the module doc: a node's agent cannot rejoin, so a restarted pod would not help
APP_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
APP = "nemo-checkpointless"

_WAIT_FOR_STORE = """import socket, sys, time
host, port, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
end = time.monotonic() + limit
while True:
    try:
        socket.create_connection((host, port), timeout=2).close()
        break
    except OSError as e:
        if time.monotonic() > end:
            sys.exit(f"store {host}:{port} not reachable after {limit:.0f} s: {e}")
        time.sleep(1)
"""


def _models() -> tuple[Any, Any]:
    """(kubernetes.client, kubeflow.training) or one ConfigError naming the extra."""
    try:
        import kubeflow.training as kf
        import kubernetes.client as k8s
    except ImportError as e:
        raise ConfigError("launcher.target", "k8s", f"builds the PyTorchJob with the Kubernetes and Kubeflow training "
                          f"Python clients, which are not installed here ({e.name} is missing)",
                          "pip install 'nemo-checkpointless[cluster]' (or pip install kubeflow-training kubernetes)"
                          ) from None
    return k8s, kf


def _k8s_args(args: list[str]) -> list[str]:
    """Kubernetes expands `$(VAR)` in a container's args: a user's literal `$(` is written `$$(`."""
    return [a.replace("$(", "$$(") for a in args]


def _labels(name: str, component: str) -> dict[str, str]:
    return {APP_LABEL: APP, INSTANCE_LABEL: name, "app.kubernetes.io/component": component}


def store_objects(cfg: Config, image: str) -> list[Any]:
    """The store's Deployment and Service (Kubernetes client models)."""
    k8s, _ = _models()
    name = job.job_name(cfg)
    labels = _labels(name, "store")
    port = job.STORE_PORT
    container = k8s.V1Container(
        name="store", image=image, command=["checkpointless-store"],
        args=["--host", "0.0.0.0", "--port", str(port)],
        ports=[k8s.V1ContainerPort(name="store", container_port=port, protocol="TCP")],
        env=[k8s.V1EnvVar(name="PYTHONUNBUFFERED", value="1")],
        readiness_probe=k8s.V1Probe(tcp_socket=k8s.V1TCPSocketAction(port=port), period_seconds=2),
        resources=k8s.V1ResourceRequirements(requests={"cpu": "1", "memory": "1Gi"}))
    deployment = k8s.V1Deployment(
        api_version="apps/v1", kind="Deployment",
        metadata=k8s.V1ObjectMeta(name=f"{name}-store", labels=labels),
        spec=k8s.V1DeploymentSpec(
            replicas=1, strategy=k8s.V1DeploymentStrategy(type="Recreate"),
            selector=k8s.V1LabelSelector(match_labels=labels),
            template=k8s.V1PodTemplateSpec(metadata=k8s.V1ObjectMeta(labels=labels),
                                           spec=k8s.V1PodSpec(containers=[container]))))
    service = k8s.V1Service(
        api_version="v1", kind="Service", metadata=k8s.V1ObjectMeta(name=f"{name}-store", labels=labels),
        spec=k8s.V1ServiceSpec(selector=labels, ports=[k8s.V1ServicePort(name="store", port=port,
                                                                         target_port=port, protocol="TCP")]))
    return [deployment, service]


def _volumes(cfg: Config) -> tuple[list[Any], list[Any]]:
    """(volumes, mounts): /dev/shm in memory, sized for the data cache; a cache_root elsewhere, on the node's disk."""
    k8s, _ = _models()
    size = job.shm_size(cfg)
    in_shm = job.cache_in_shm(cfg)
    shm = size.limit_bytes if in_shm else size.reserve_limit_bytes
    volumes = [k8s.V1Volume(name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory",
                                                                            size_limit=job.gib(shm)))]
    mounts = [k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm")]
    if not in_shm:
        volumes.append(k8s.V1Volume(name="data-cache", empty_dir=k8s.V1EmptyDirVolumeSource(
            size_limit=job.gib(size.cache_limit_bytes))))
        mounts.append(k8s.V1VolumeMount(name="data-cache", mount_path=job.cache_root(cfg)))
    return volumes, mounts


def _resources(cfg: Config) -> Any:
    """GPU nodes: `nvidia.com/gpu: trainer.devices`. CPU: one core per rank and hot spare thread, plus the agent."""
    k8s, _ = _models()
    t = cfg.trainer
    if t.accelerator == "gpu":
        return k8s.V1ResourceRequirements(limits={"nvidia.com/gpu": str(t.devices)})
    cpus = (t.devices + cfg.replication.spares) * cfg.launcher.threads_per_rank + 1
    return k8s.V1ResourceRequirements(requests={"cpu": str(cpus)})


def pod_template(cfg: Config, overrides: list[str], image: str) -> Any:
    """The pod of every node: one agent, its node rank from the operator's PET_NODE_RANK."""
    k8s, _ = _models()
    name = job.job_name(cfg)
    store_host = f"{name}-store"
    args = job.agent_args(cfg, _k8s_args(overrides), f"$({NODE_RANK_ENV})", f"{store_host}:{job.STORE_PORT}")
    volumes, mounts = _volumes(cfg)
    env = [k8s.V1EnvVar(name=k, value=v) for k, v in job.rank_env(cfg).items()]
    agent = k8s.V1Container(
        name=CONTAINER, image=image, command=["checkpointless-train"], args=args, env=env,
        ports=[k8s.V1ContainerPort(name=OPERATOR_PORT_NAME, container_port=OPERATOR_PORT, protocol="TCP")],
        resources=_resources(cfg), volume_mounts=mounts)
    wait = k8s.V1Container(
        name="wait-for-store", image=image, command=["python3", "-c", _WAIT_FOR_STORE],
        args=[store_host, str(job.STORE_PORT), f"{cfg.launcher.start_timeout_s:g}"])
    return k8s.V1PodTemplateSpec(
        metadata=k8s.V1ObjectMeta(labels=_labels(name, "agent")),
        spec=k8s.V1PodSpec(init_containers=[wait], containers=[agent], volumes=volumes))


def pytorch_job(cfg: Config, overrides: list[str], image: str) -> Any:
    """The `KubeflowOrgV1PyTorchJob`: Master (node 0) + Workers (nodes 1 .., the spare nodes last)."""
    k8s, kf = _models()
    from kubeflow.training.constants import constants as c

    template = pod_template(cfg, overrides, image)
    specs = {c.REPLICA_TYPE_MASTER: kf.KubeflowOrgV1ReplicaSpec(replicas=1, restart_policy=RESTART_POLICY,
                                                                 template=template)}
    if job.num_agents(cfg) > 1:
        specs[c.REPLICA_TYPE_WORKER] = kf.KubeflowOrgV1ReplicaSpec(
            replicas=job.num_agents(cfg) - 1, restart_policy=RESTART_POLICY, template=template)
    name = job.job_name(cfg)
    return kf.KubeflowOrgV1PyTorchJob(
        api_version=c.API_VERSION, kind=c.PYTORCHJOB_KIND,
        metadata=k8s.V1ObjectMeta(name=name, labels=_labels(name, "job")),
        spec=kf.KubeflowOrgV1PyTorchJobSpec(pytorch_replica_specs=specs, run_policy=kf.KubeflowOrgV1RunPolicy()))


def to_dict(obj: Any) -> Any:
    """A model as the API's JSON (camelCase keys, no nulls)."""
    k8s, _ = _models()
    return k8s.ApiClient().sanitize_for_serialization(obj)


def manifests(cfg: Config, overrides: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the store's Deployment and Service, the PyTorchJob) as dicts."""
    image = job.image()
    return [to_dict(o) for o in store_objects(cfg, image)], to_dict(pytorch_job(cfg, overrides, image))


def _header(cfg: Config, what: str) -> str:
    t, r = cfg.trainer, cfg.replication
    return "".join(job.comment(line) for line in (
        what, f"Written by checkpointless-train launcher.target=k8s for recipe={cfg.recipe_name}: {t.num_nodes} "
        f"training node(s) + {r.spare_nodes} spare node(s), {t.devices} ranks each.",
        f"Image: {job.image()} (${job.IMAGE_ENV}); it must have nemo-checkpointless installed.",
        job.shm_size(cfg).formula(cfg)))


def dump_yaml(docs: list[Any]) -> str:
    """YAML documents in the order of their keys, a multi-line string as a literal block."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    return yaml.dump_all(docs, Dumper=Dumper, sort_keys=False)


def write(cfg: Config, overrides: list[str], out_dir: Path) -> list[Path]:
    """Write OUT/store.yaml and OUT/pytorchjob.yaml; return their paths."""
    store, pj = manifests(cfg, overrides)
    out_dir.mkdir(parents=True, exist_ok=True)
    store_path, job_path = out_dir / "store.yaml", out_dir / "pytorchjob.yaml"
    store_path.write_text(_header(cfg, "The job's store: apply before pytorchjob.yaml.") + dump_yaml(store))
    job_path.write_text(_header(cfg, f"One agent per node; node rank from the training operator's "
                                     f"{NODE_RANK_ENV} (Master 0, Worker i -> i + 1).") + dump_yaml([pj]))
    return [store_path, job_path]
