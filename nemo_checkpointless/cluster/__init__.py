"""Cluster launch files from a recipe: `checkpointless-train ... launcher.target=k8s` writes a Kubeflow PyTorchJob
and the job's store (`k8s`), `launcher.target=slurm` an sbatch script (`slurm`); both start one agent per node on the
same command line (`job.agent_args`). See docs/cluster.md.
"""

from __future__ import annotations

from pathlib import Path

from nemo_checkpointless.config import Config


def write_launch_files(cfg: Config, overrides: list[str], prog: str = "checkpointless-train") -> int:
    """Write the launch files of `cfg.launcher.target` under RUN_DIR/<target>/, print them and the command that
    submits them; 0. A setting that cannot hold on every node, or a missing library, raises ConfigError."""
    from nemo_checkpointless.cluster import job

    job.check_cluster_config(cfg, overrides)
    target = cfg.launcher.target
    out_dir = Path(cfg.run.dir) / target
    if target == "k8s":
        from nemo_checkpointless.cluster import k8s

        paths = k8s.write(cfg, overrides, out_dir)
        submit = "kubectl apply " + " ".join(f"-f {p}" for p in paths)
        store = f"{job.job_name(cfg)}-store:{job.STORE_PORT}"
        what = f"a PyTorchJob of {job.num_agents(cfg)} pod(s) and its store ({store})"
    else:
        from nemo_checkpointless.cluster import slurm

        paths = slurm.write(cfg, overrides, out_dir)
        submit = f"sbatch {paths[0]}"
        what = f"an sbatch script for {job.num_agents(cfg)} node(s), the store on the batch host"
    t, r = cfg.trainer, cfg.replication
    print(f"{prog}: wrote {what}: {t.num_nodes} training node(s) + {r.spare_nodes} spare node(s), "
          f"{t.devices} ranks each:")
    for p in paths:
        print(f"  {p}")
    print(f"{prog}: submit with: {submit}")
    return 0
