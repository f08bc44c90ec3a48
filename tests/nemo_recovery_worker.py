"""A NeMo tiny-Llama rank (or hot spare) under our launcher, with in-process replacement: `python -m
nemo_recovery_worker` (tests/ on PYTHONPATH), started by `launcher.local.run_local(...,
worker_module="nemo_recovery_worker")` from tests/nemo_recovery_run.py.

Every generation's `fit` runs on a default group made from the launcher's store (prefix `nemo/gen<g>/`) with a
short gloo timeout (`pg_timeout_s` in RUN_DIR/nemo_job.json). A failure makes every survivor leave `fit` in its own
process; it runs `RecoveryEngine.recover` (sending its shard to the replacement it is the source of), abandons the
old default group and enters `fit` again with its own boundary state kept in memory. A hot spare, handed the dead
rank, runs `RecoveryEngine.join` and enters `fit` with the state it received from its replica (p2p). Rank 0 writes
RUN_DIR/worker_summary.json (final step, `state_sha256` over every rank's params and optimizer shard); every rank
writes RUN_DIR/nemo_rank<r>.json. The fault (`fault.plan`, kind kill) is injected when its rank starts its step
(1-based, as in the Lightning path).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import nemo_shim

nemo_shim.install()

import lightning.pytorch as pl  # noqa: E402
import nemo_tiny_llama  # noqa: E402  (imports NeMo: a spare is warm once this is done)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402
from nemo import lightning as nl  # noqa: E402

from nemo_checkpointless.launcher.local import spare_assign_key, spare_ready_key  # noqa: E402
from nemo_checkpointless.nemo import CheckpointlessMegatronStrategy  # noqa: E402
from nemo_checkpointless.nemo.restart import (  # noqa: E402
    FaultWatch,
    ReceivedState,
    abandon_default_group,
    own_boundary_state,
)
from nemo_checkpointless.restart.groups import Membership, PeerFailure, connect_store, fault_generation  # noqa: E402
from nemo_checkpointless.restart.recovery import RecoveryEngine, RecoveryStamps  # noqa: E402
from nemo_checkpointless.restart.worker_env import ENV_PREFIX  # noqa: E402
from nemo_checkpointless.state.hashing import state_digest  # noqa: E402
from nemo_checkpointless.topology import ParallelDims  # noqa: E402

GLOBAL_BATCH = 8
TRAIN_START_KEY = "job/train_start"
_STORE: list[dist.Store] = []
_STAMPS: list[RecoveryStamps] = []  # module-level for the same reason as _STORE (see _Job.store)


class _Job(pl.Callback):
    """Fault injection, recovery timing stamps, and the end-of-run digests."""

    def __init__(self, job: dict[str, Any], rank: int, run_dir: Path) -> None:
        self.job, self.rank, self.run_dir = job, rank, run_dir

    @property
    def store(self) -> dist.Store:
        # Not an attribute: NeMo's Trainer deep-copies its callbacks for its io config, and a store cannot be.
        return _STORE[0]

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        tensor_parallel.model_parallel_cuda_manual_seed(nemo_tiny_llama.SEED)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step = trainer.global_step + 1  # 1-based, as fault.plan counts (the Lightning path's callback too)
        if self.rank == 0 and not self.store.check([TRAIN_START_KEY]):
            self.store.set(TRAIN_START_KEY, json.dumps(time.time()))
        for i, spec in enumerate(self.job["faults"]):
            key = f"job/fault/{i}/injected"
            if spec["rank"] == self.rank and spec["step"] == step and not self.store.check([key]):
                self.store.set(key, json.dumps({"t": time.time(), "kind": "kill", "rank": self.rank, "step": step}))
                print(f"[rank {self.rank}] injected fault: SIGKILL at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        _STAMPS[0].stamp(trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, CheckpointlessMegatronStrategy) and strategy.participant is not None
        part = strategy.participant
        part.at_step_boundary(trainer.global_step)
        tensors, _ = part.boundary_state()
        params = state_digest({k: v for k, v in tensors.items() if k.startswith("model.")}, {})
        shard = state_digest({k: v for k, v in tensors.items() if k.startswith("opt")}, {})
        rng = state_digest({k: v for k, v in tensors.items() if k.startswith("rng.")}, {})
        mine = torch.tensor(list(hashlib.sha256(f"{params}:{shard}".encode()).digest()), dtype=torch.uint8)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        record = {"rank": self.rank, "pid": os.getpid(), "step": trainer.global_step, "params_sha256": params,
                  "shard_sha256": shard, "rng_sha256": rng}
        (self.run_dir / f"nemo_rank{self.rank}.json").write_text(json.dumps(record, indent=1))
        if self.rank == 0:
            total = hashlib.sha256(b"".join(bytes(t.tolist()) for t in every)).hexdigest()
            (self.run_dir / "worker_summary.json").write_text(json.dumps(
                {"final_step": trainer.global_step, "state_sha256": total, "train_end_t": time.time()}))


def _wait_for_assignment(store: dist.Store, spare_id: int) -> dict[str, int]:
    while True:
        try:
            store.wait([spare_assign_key(spare_id)], datetime.timedelta(seconds=60))
            return dict(json.loads(store.get(spare_assign_key(spare_id))))
        except RuntimeError:
            continue


def _wait_for_fault(store: dist.Store, generation: int, patience_s: float) -> bool:
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        if fault_generation(store) >= generation:
            return True
        time.sleep(0.01)
    return False


def run() -> None:
    environ = os.environ
    host, port = environ[f"{ENV_PREFIX}STORE_HOST"], int(environ[f"{ENV_PREFIX}STORE_PORT"])
    run_dir = Path(environ[f"{ENV_PREFIX}RUN_DIR"])
    job = json.loads((run_dir / "nemo_job.json").read_text())
    store = connect_store(host, port, 300)
    _STORE.append(store)
    world = int(environ["WORLD_SIZE"])
    join_generation = 0
    if f"{ENV_PREFIX}SPARE_ID" in environ:
        spare_id = int(environ[f"{ENV_PREFIX}SPARE_ID"])
        store.set(spare_ready_key(spare_id), "1")
        assignment = _wait_for_assignment(store, spare_id)
        rank, join_generation = assignment["rank"], assignment["generation"]
    else:
        rank = int(environ["RANK"])
        join_generation = int(environ.get(f"{ENV_PREFIX}JOIN_GENERATION", "0"))
    environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0")
    dims = ParallelDims(world_size=world, num_instances=job["num_instances"])
    membership = Membership(store, rank, world, host, job["engine_timeout_s"])
    engine = RecoveryEngine(membership, dims, None)
    resume: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None
    stamps = RecoveryStamps(store, rank)
    _STAMPS.append(stamps)
    if join_generation:
        membership.generation = join_generation - 1
        received = ReceivedState()
        decision = engine.join(received, join_generation)
        if decision.path != "p2p" or received.state is None:
            raise RuntimeError(f"rank {rank}: recovery decided {decision}; the NeMo path has no checkpoint fallback")
        resume = received.state
        stamps.track(membership.generation)
        print(f"[rank {rank}] joined generation {membership.generation}: state of step {decision.step} received "
              f"p2p ({engine.bytes_received} bytes)", flush=True)
    while True:
        generation = membership.generation
        model, data = nemo_tiny_llama.build_model_and_data()
        strategy = CheckpointlessMegatronStrategy(
            num_instances=job["num_instances"], global_batch_size=GLOBAL_BATCH, ckpt_async_save=False,
            pg_timeout_s=job["pg_timeout_s"])
        strategy.use_generation(dist.PrefixStore(f"nemo/gen{generation}/", store), resume)
        resume = None
        trainer = nl.Trainer(accelerator="cpu", devices=world, max_steps=job["steps"], strategy=strategy,
                             logger=False, enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
                             enable_progress_bar=False, callbacks=[_Job(job, rank, run_dir)],
                             log_every_n_steps=1)
        watch = FaultWatch(store, generation, keep_ports={port}) if job.get("fault_watch", True) else None
        try:
            if watch is not None:
                with watch:
                    trainer.fit(model, datamodule=data)
            else:
                trainer.fit(model, datamodule=data)
            return
        except Exception as e:  # a peer failed (a gloo error, or the timeout of a collective it never joined)
            if not _wait_for_fault(store, generation, patience_s=job["pg_timeout_s"] + 5):
                raise
            t = time.time()
            part = strategy.participant
            assert part is not None
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            if watch is not None and watch.fired_t is not None:
                why += f" (fault watch closed {watch.closed} sockets)"
            print(f"[rank {rank}] left fit at step {part.completed_steps}: {why}", flush=True)
            resume = own_boundary_state(part)
            decision = engine.recover(part, PeerFailure(f"{type(e).__name__} in NeMo's fit"))
            if decision.path != "p2p":
                raise RuntimeError(f"rank {rank}: recovery decided {decision}; no checkpoint fallback here") from e
            abandoned = abandon_default_group()
            stamps.track(membership.generation)
            print(f"[rank {rank}] recovered p2p at step {decision.step} in {time.time() - t:.2f} s (generation "
                  f"{membership.generation}, {abandoned} old groups abandoned); entering fit again", flush=True)


def main() -> int:
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    code = 0
    try:
        run()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # abandoned gloo groups must not be torn down at exit


if __name__ == "__main__":
    raise SystemExit(main())
