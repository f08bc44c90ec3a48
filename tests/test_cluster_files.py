"""launcher.target=k8s|slurm: the launch files, checked by what will read them.

- The PyTorchJob is read back strictly through the Kubeflow training SDK's models (the operator's swagger types:
  an unknown field, a wrong type or a missing required field fails; the round trip must give the same JSON), its pod
  templates and the store's Deployment and Service are validated against the Kubernetes OpenAPI schema
  (`kubernetes-validate`, strict: no unknown fields), and the training operator's own admission rules are applied.
  No installable package ships the PyTorchJob CRD: with `NCL_PYTORCHJOB_CRD=path/to/kubeflow.org_pytorchjobs.yaml`
  (the training-operator repository's manifests/base/crds/) the manifest is also validated against its
  openAPIV3Schema.
- The sbatch script: `bash -n`; run by bash with stand-ins for srun, the store and the agent (the store must be up
  before the agents start, each node's agent gets its own rank, the store is stopped at the end); and submitted with
  `sbatch --test-only` to a real slurmctld on loopback (skipped, saying why, when Slurm is not installed).
- Every agent's command composes back to the user's job, with only the node's launcher settings changed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from nemo_checkpointless.cli.compose import compose
from nemo_checkpointless.cli.train import main
from nemo_checkpointless.cluster import job, k8s, slurm
from nemo_checkpointless.config import Config

kf_models = pytest.importorskip("kubeflow.training.models", reason="needs the [cluster] extra (kubeflow-training)")
k8s_client = pytest.importorskip("kubernetes.client", reason="needs the [cluster] extra (kubernetes)")

BIG = ["recipe=llama3_70b", "trainer.num_nodes=16", "replication.spare_nodes=1",
       "fault.plan=[{kind:kill,rank:9,step:3}]"]
JOBS = {
    "llama3_70b-16+1": BIG,
    "tiny-cpu-2": ["trainer.num_nodes=2", "trainer.devices=2", "replication.spares=1"],
    "tiny-1-node": ["data.cache_root=/local/ncl-cache", "data.loader=mmap"],
    "script": ["recipe=llama32_1b", "trainer.num_nodes=2", "script=pretrain.py",
               "script_args=[--lr,3e-3,--name,'$(whoami)']"],
}


def _compose(overrides: list[str], target: str, tmp: Path) -> tuple[Config, list[str]]:
    args = [*overrides, f"launcher.target={target}", f"run.dir={tmp}/exp"]
    return compose(args), args


# --------------------------------------------------------------------------------------- strict model read-back
_SCALARS: dict[str, Any] = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}


def read_model(data: Any, type_name: str, path: str = "$") -> Any:
    """`data` (API JSON) as an instance of the SDK model `type_name`, refusing what the SDK's own deserializer lets
    through silently: fields the model does not have, and values of the wrong type. Required fields are the
    models' (their constructors raise on a missing one)."""
    if m := re.fullmatch(r"list\[(.+)\]", type_name):
        assert isinstance(data, list), f"{path}: {type_name} expected, got {data!r}"
        return [read_model(x, m.group(1), f"{path}[{i}]") for i, x in enumerate(data)]
    if m := re.fullmatch(r"dict\(str, (.+)\)", type_name):
        assert isinstance(data, dict), f"{path}: {type_name} expected, got {data!r}"
        return {k: read_model(v, m.group(1), f"{path}.{k}") for k, v in data.items()}
    if type_name in _SCALARS:
        assert isinstance(data, _SCALARS[type_name]) and not (type_name == "int" and isinstance(data, bool)), \
            f"{path}: {type_name} expected, got {data!r}"
        return data
    cls = getattr(kf_models, type_name, None) or getattr(k8s_client, type_name)
    assert isinstance(data, dict), f"{path}: {type_name} expected, got {data!r}"
    fields = {json_name: attr for attr, json_name in cls.attribute_map.items()}
    unknown = sorted(set(data) - set(fields))
    assert not unknown, f"{path}: {type_name} has no field(s) {unknown}"
    return cls(**{fields[k]: read_model(v, cls.openapi_types[fields[k]], f"{path}.{k}") for k, v in data.items()})


def _k8s_schema_check(obj: dict[str, Any]) -> None:
    """Strict JSON-schema validation against the oldest and newest Kubernetes API that kubernetes-validate ships."""
    kv = pytest.importorskip("kubernetes_validate", reason="needs the [dev] extra (kubernetes-validate)")
    versions = sorted(set(kv.utils.all_versions()), key=lambda v: tuple(int(x) for x in v.split(".")))
    for version in (versions[0], versions[-1]):
        kv.validate(obj, version, strict=True)


def _pod_template_object(template: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "agent"}, "template": template}


@pytest.mark.parametrize("name", list(JOBS))
def test_pytorchjob_reads_back_through_the_sdk_and_validates(name: str, tmp_path: Path) -> None:
    cfg, args = _compose(JOBS[name], "k8s", tmp_path)
    store, pj = k8s.manifests(cfg, args)
    # Through the YAML text, as kubectl reads it.
    pj = yaml.safe_load(k8s.dump_yaml([pj]))
    model = read_model(pj, "KubeflowOrgV1PyTorchJob")
    assert k8s.to_dict(model) == pj
    for obj, type_name in zip(store, ("V1Deployment", "V1Service"), strict=True):
        assert k8s.to_dict(read_model(obj, type_name)) == obj
        _k8s_schema_check(obj)
    for spec in pj["spec"]["pytorchReplicaSpecs"].values():
        _k8s_schema_check(_pod_template_object(spec["template"]))


@pytest.mark.parametrize("name", list(JOBS))
def test_pytorchjob_meets_the_training_operators_rules(name: str, tmp_path: Path) -> None:
    """The operator's admission webhook (pkg/webhooks/pytorch) and what the job relies on from its controller."""
    cfg, args = _compose(JOBS[name], "k8s", tmp_path)
    store, pj = k8s.manifests(cfg, args)
    name_ = pj["metadata"]["name"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name_) and len(name_) <= 63
    specs = pj["spec"]["pytorchReplicaSpecs"]
    assert set(specs) <= {"Master", "Worker"}
    # PET_NODE_RANK is set only when the job has a Master: Master 0, Worker i -> i + 1.
    assert specs["Master"]["replicas"] == 1
    nodes = cfg.trainer.num_nodes + cfg.replication.spare_nodes
    assert sum(s["replicas"] for s in specs.values()) == nodes
    assert ("Worker" in specs) == (nodes > 1)
    for spec in specs.values():
        assert spec["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
        pod = spec["template"]["spec"]
        (agent,) = [c for c in pod["containers"] if c["name"] == "pytorch"]
        assert all(c["image"] for c in pod["containers"] + pod["initContainers"])
        assert any(p["name"] == "pytorchjob-port" for p in agent["ports"])
        assert agent["command"] == ["checkpointless-train"]
        assert agent["args"][-4:] == ["launcher.target=local", "launcher.node_rank=$(PET_NODE_RANK)",
                                      f"launcher.rdzv_endpoint={name_}-store:29400", "launcher.rdzv_backend=external"]
        limits = agent["resources"].get("limits", {})
        assert limits.get("nvidia.com/gpu") == (str(cfg.trainer.devices) if cfg.trainer.accelerator == "gpu" else None)
        (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in agent["volumeMounts"]
        env = {e["name"]: e["value"] for e in agent["env"]}
        assert env["OMP_NUM_THREADS"] == str(cfg.launcher.threads_per_rank)
        assert "PET_NODE_RANK" not in env  # the operator's to set
    service = store[1]
    assert service["metadata"]["name"] == f"{name_}-store" and service["spec"]["ports"][0]["port"] == 29400
    assert service["spec"]["selector"] == store[0]["spec"]["template"]["metadata"]["labels"]


def test_pytorchjob_against_the_crd_schema(tmp_path: Path) -> None:
    crd_path = os.environ.get("NCL_PYTORCHJOB_CRD")
    if not crd_path:
        pytest.skip("no installable package ships the PyTorchJob CRD: set NCL_PYTORCHJOB_CRD to "
                    "kubeflow.org_pytorchjobs.yaml (training-operator manifests/base/crds/) to run this check")
    import jsonschema

    crd = yaml.load(Path(crd_path).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = version["schema"]["openAPIV3Schema"]
    for overrides in JOBS.values():
        cfg, args = _compose(overrides, "k8s", tmp_path)
        jsonschema.validate(k8s.manifests(cfg, args)[1], schema)
        # The check bites: a replica count that is not an integer is refused.
        bad = json.loads(json.dumps(k8s.manifests(cfg, args)[1]))
        bad["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = "one"
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_strict_read_back_refuses_what_the_operator_would(tmp_path: Path) -> None:
    """The checks above bite: an unknown field, a wrong type, a missing required field."""
    cfg, args = _compose(BIG, "k8s", tmp_path)
    pj = k8s.manifests(cfg, args)[1]
    for mutate in (lambda d: d["spec"].update(pytorchReplicaSpec={}),
                   lambda d: d["spec"]["pytorchReplicaSpecs"]["Worker"].update(replicas="16"),
                   lambda d: d["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
                   .pop("name")):
        bad = json.loads(json.dumps(pj))
        mutate(bad)
        with pytest.raises((AssertionError, ValueError)):
            read_model(bad, "KubeflowOrgV1PyTorchJob")
    template = json.loads(json.dumps(pj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]))
    template["spec"]["containers"][0]["volumeMount"] = []
    kv = pytest.importorskip("kubernetes_validate")
    with pytest.raises(kv.ValidationError):
        _k8s_schema_check(_pod_template_object(template))


# ---------------------------------------------------------------------------------------- the agents' command
def _launcher_as_agent(cfg: Config, node_rank: int, endpoint: str) -> Config:
    lc = dataclasses.replace(cfg.launcher, target="local", node_rank=node_rank, rdzv_endpoint=endpoint,
                             rdzv_backend="external")
    return dataclasses.replace(cfg, launcher=lc)


@pytest.mark.parametrize("name", ["llama3_70b-16+1", "script"])
def test_every_pods_command_composes_to_the_users_job(name: str, tmp_path: Path) -> None:
    cfg, args = _compose(JOBS[name], "k8s", tmp_path)
    pj = k8s.manifests(cfg, args)[1]
    agent = pj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    last = cfg.trainer.num_nodes + cfg.replication.spare_nodes - 1
    # What Kubernetes passes after expanding $(PET_NODE_RANK) (and turning $$( back into a literal $( ).
    argv = [a.replace("$(PET_NODE_RANK)", str(last)).replace("$$(", "$(") for a in agent["args"]]
    assert compose(argv) == _launcher_as_agent(cfg, last, f"{pj['metadata']['name']}-store:29400")
    if name == "script":  # a user's script and its arguments reach every agent as given
        assert "script=pretrain.py" in argv and "script_args=[--lr,3e-3,--name,'$(whoami)']" in argv


# ------------------------------------------------------------------------------------------------------- slurm
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_SRUN = """#!/bin/bash
# Stand-in for srun inside an allocation: its options are skipped; one task per node (--nodes=N), in parallel,
# each with its SLURM_NODEID and SLURM_PROCID.
nodes=1
while [[ $1 == -* ]]; do
  case $1 in --nodes=*) nodes=${1#--nodes=} ;; esac
  echo "$1" >> "$STUB_OUT/srun.opts"
  shift
done
pids=()
for ((i = 0; i < nodes; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i "$@" & pids+=($!); done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""

_STORE = """import os, signal, socket, sys
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
out = os.environ["STUB_OUT"]
with open(os.path.join(out, "store.args"), "w") as f:
    f.write("\\0".join(args))
def stop(*_):
    open(os.path.join(out, "store.stopped"), "w").close()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
s = socket.create_server(("127.0.0.1", port))
while True:
    s.accept()[0].close()
"""

_AGENT = """import os, socket, sys
args = sys.argv[1:]
endpoint = [a.split("=", 1)[1] for a in args if a.startswith("launcher.rdzv_endpoint=")][-1]
host, port = endpoint.rsplit(":", 1)
socket.create_connection((host, int(port)), timeout=5).close()  # the store is up before any agent starts
with open(os.path.join(os.environ["STUB_OUT"], f"agent-{os.environ['SLURM_NODEID']}.args"), "w") as f:
    f.write("\\0".join(args))
"""


def _stubs(bin_dir: Path) -> None:
    bin_dir.mkdir()
    for name, text in (("srun", _SRUN), ("checkpointless-store", f"#!{sys.executable}\n{_STORE}"),
                       ("checkpointless-train", f"#!{sys.executable}\n{_AGENT}")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)


def test_sbatch_script_starts_the_store_then_one_agent_per_node(tmp_path: Path) -> None:
    overrides = ["trainer.num_nodes=2", "replication.spare_nodes=1", "trainer.devices=2",
                 "fault.plan=[{kind:kill,rank:1,step:3}]", "launcher.target=slurm", f"run.dir={tmp_path}/exp"]
    cfg = compose(overrides)
    port = _free_port()
    _stubs(tmp_path / "bin")
    script = tmp_path / "job.sbatch"
    script.write_text(slurm.sbatch_script(cfg, overrides, port=port, bin_dir=str(tmp_path / "bin"),
                                          cwd=str(tmp_path)))
    subprocess.run(["bash", "-n", str(script)], check=True)
    out = tmp_path / "out"
    out.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "STUB_OUT": str(out), "SLURM_JOB_ID": "7",
           "SLURMD_NODENAME": "localhost", "SLURM_CPUS_ON_NODE": "2"}
    proc = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not re.search(r"syntax error|command not found|unbound variable", proc.stderr), proc.stderr
    assert (out / "store.args").read_text().split("\0") == ["--host", "0.0.0.0", "--port", str(port)]
    assert (out / "store.stopped").exists(), "the store outlived the script"
    opts = (out / "srun.opts").read_text().split()
    assert {"--nodes=3", "--ntasks-per-node=1", "--no-kill", "--kill-on-bad-exit=0", "--wait=0"} <= set(opts)
    for rank in range(3):
        argv = (out / f"agent-{rank}.args").read_text().split("\0")
        assert argv[0] == "recipe=tiny_llama_cpu" and "fault.plan=[{kind:kill,rank:1,step:3}]" in argv
        assert compose(argv) == _launcher_as_agent(cfg, rank, f"localhost:{port}")
    assert not list(out.glob("agent-3.args"))


def _slurm_conf(tmp: Path, nodes: int) -> Path:
    (tmp / "state").mkdir()
    conf = tmp / "slurm.conf"
    conf.write_text(f"""ClusterName=ncltest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/none
CredType=cred/none
SlurmUser={pwd.getpwuid(os.getuid()).pw_name}
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmctldLogFile={tmp}/slurmctld.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
GresTypes=gpu
SuspendProgram=/bin/true
ResumeProgram=/bin/true
SuspendTime=600
NodeName=n[0-{nodes - 1}] NodeAddr=127.0.0.1 CPUs=16 Gres=gpu:8 State=CLOUD
PartitionName=batch Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
    return conf


SLURMCTLD = shutil.which("slurmctld") or shutil.which("slurmctld", path="/usr/sbin:/sbin")


@pytest.mark.skipif(not (SLURMCTLD and all(shutil.which(c) for c in ("sbatch", "srun", "scontrol"))),
                    reason="Slurm is not installed (apt-get install slurmctld slurm-client; scripts/test.sh does)")
def test_sbatch_test_only_against_a_real_slurmctld(tmp_path: Path) -> None:
    """17 GPU nodes (16 + 1 spare) of 8 GPUs, as Slurm's controller itself judges the script's #SBATCH lines and its
    srun options."""
    conf = _slurm_conf(tmp_path, nodes=18)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    assert SLURMCTLD
    ctld = subprocess.Popen([SLURMCTLD, "-D", "-i", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    try:
        # Until the controller answers (a controller that stopped fails here; one that never answers, at the
        # test's timeout: its start takes what the machine's load makes it take).
        while "is UP" not in subprocess.run(["scontrol", "ping"], env=env, capture_output=True, text=True).stdout:
            assert ctld.poll() is None, (tmp_path / "slurmctld.log").read_text()[-2000:]
            time.sleep(0.2)

        def test_only(overrides: list[str]) -> subprocess.CompletedProcess[str]:
            cfg, args = _compose(overrides, "slurm", tmp_path)
            paths = slurm.write(cfg, args, tmp_path / "exp" / "slurm")
            return subprocess.run(["sbatch", "--test-only", str(paths[0])], env=env, cwd=tmp_path,
                                  capture_output=True, text=True, timeout=30)

        ok = test_only(BIG)
        assert ok.returncode == 0 and "to start at" in ok.stderr and "on nodes n[0-16]" in ok.stderr, ok.stderr
        # The script's srun options too, as an allocation of their own (16 CPUs: what each node has).
        text = (tmp_path / "exp" / "slurm" / "job.sbatch").read_text().replace("\\\n", " ")
        srun = re.search(r"^srun (.*?) bash -c ", text, re.M)
        assert srun, text
        opts = shlex.split(srun.group(1).replace('"${SLURM_CPUS_ON_NODE:-1}"', "16"))
        step = subprocess.run(["srun", "--test-only", *opts, "true"], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=30)
        assert step.returncode == 0 and "on nodes n[0-16]" in step.stderr, (opts, step.stderr)
        # And it is the controller that judges: more GPUs per node, or more nodes, than the cluster has are refused.
        for too_big in (["trainer.devices=16", *BIG], [*BIG, "replication.spare_nodes=3"]):
            refused = test_only(too_big)
            assert refused.returncode != 0 and "configuration is not available" in refused.stderr, refused.stderr
    finally:
        ctld.terminate()
        try:
            ctld.wait(10)
        except subprocess.TimeoutExpired:
            ctld.kill()
            ctld.wait()


# -------------------------------------------------------------------------------------------------- the CLI
def test_cli_writes_the_files_and_says_how_to_submit(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(job.IMAGE_ENV, "registry.example.com/ncl:1")
    assert main([*BIG, "launcher.target=k8s"]) == 0
    out = capsys.readouterr().out
    assert "kubectl apply -f runs/llama3_70b/k8s/store.yaml -f runs/llama3_70b/k8s/pytorchjob.yaml" in out
    docs = list(yaml.safe_load_all((tmp_path / "runs/llama3_70b/k8s/pytorchjob.yaml").read_text()))
    assert docs[0]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["image"] == \
        "registry.example.com/ncl:1"
    assert main([*BIG, "launcher.target=slurm", "run.dir=runs/exp2"]) == 0
    assert "sbatch runs/exp2/slurm/job.sbatch" in capsys.readouterr().out
    text = (tmp_path / "runs/exp2/slurm/job.sbatch").read_text()
    assert "#SBATCH --nodes=17" in text and "#SBATCH --gres=gpu:8" in text
    assert main([*BIG, "launcher.target=k8s", "--cfg", "run.dir=runs/cfg"]) == 0  # --cfg prints, writes nothing
    assert "target: k8s" in capsys.readouterr().out and not (tmp_path / "runs/cfg").exists()


@pytest.mark.parametrize(("extra", "fragment"), [
    (["launcher.node_rank=2"], "launcher.node_rank=2: is set for each node by the launch files (from PET_NODE_RANK)"),
    (["launcher.rdzv_endpoint=h:1"], "launcher.rdzv_endpoint=h:1: launcher.target=k8s runs the job's own"),
    (["launcher.rdzv_backend=c10d"], "launcher.rdzv_backend=c10d: launcher.target=k8s runs the store apart"),
    (["launcher.local_addr=10.0.0.1"], "launcher.local_addr=10.0.0.1: is one node's own address"),
])
def test_settings_of_one_node_are_one_clear_message(extra: list[str], fragment: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BIG, "launcher.target=k8s", f"run.dir={tmp_path}/x", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err, err
    assert not (tmp_path / "x").exists()


def test_a_missing_library_or_image_is_one_clear_message(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(job.IMAGE_ENV, "")
    assert main(["launcher.target=k8s", f"run.dir={tmp_path}/x"]) == 2
    assert "NCL_IMAGE='': must name a container image" in capsys.readouterr().err
    monkeypatch.delenv(job.IMAGE_ENV)
    monkeypatch.setitem(sys.modules, "kubeflow.training", None)  # an import of it raises ImportError
    assert main(["launcher.target=k8s", f"run.dir={tmp_path}/x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'nemo-checkpointless[cluster]'" in err, err
    # Slurm needs no library.
    assert main(["launcher.target=slurm", f"run.dir={tmp_path}/x"]) == 0


def test_shared_memory_size() -> None:
    """The formula, on the 70B recipe: 1 x 8193 int64 tokens = 65,544 B -> 65,600 aligned + 4 KiB index; 8 ranks x
    (16 + 4 + 2) batches = 12.3 MB of cache; 2 x cache + 1 GiB + 8 x 256 MiB -> 4 GiB."""
    cfg = compose(["recipe=llama3_70b"])
    size = job.shm_size(cfg)
    assert size.batch_bytes == 65_600 + 4096 and size.cache_bytes == 8 * 22 * 69_696
    assert job.gib(size.limit_bytes) == "4Gi"
    assert job.shm_size(compose(["recipe=llama3_70b", "data.loader=plain"])).cache_bytes == 0
    big = job.shm_size(compose(["recipe=llama3_70b", "data.prefetch=4000"]))  # the cache itself counts
    assert big.limit_bytes == -(-(2 * 8 * 4006 * 69_696 + 3 * job.GIB) // job.GIB) * job.GIB


def test_job_name_is_a_dns_label_that_leaves_room_for_pod_names(tmp_path: Path) -> None:
    cfg = compose(["trainer.num_nodes=100", f"run.dir={tmp_path}/My_Experiment.{'x' * 80}"])
    name = job.job_name(cfg)
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(f"{name}-worker-99") <= 63
    assert job.job_name(compose(["run.dir=runs/7b"])) == "ncl-7b"
