"""`checkpointless-export`: a NeMo run's persistent checkpoint as a Hugging Face Llama directory.

- A real `checkpointless-train recipe=tiny_llama_nemo parallel.tp=2 parallel.pp=2` job (4 CPU ranks, one
  checkpoint file per TP/PP slice at steps 1 and 2) is exported (the newest step by default, and `--step 1`): the
  export merges the four slices. `transformers.LlamaForCausalLM.from_pretrained` loads each export; on a fixed
  token batch its logits equal, within 1e-4 (fp32), (1) those of megatron-core's own TP=2 x PP=2 `GPTModel`s, one
  per slice, run as the job ran them (4 forked gloo ranks, each loaded strictly with its slot's file, hidden
  states sent between the stages, vocab-parallel logits gathered): this checks the merge, against megatron's own
  sharded computation; and (2) those of a TP=1 megatron `GPTModel` loaded strictly with `export.merge_slices`'
  output (megatron's TP=1 names): this checks the mapping to Hugging Face names alone. All in one subprocess (the
  CPU shim is process-wide). Skipped without the [nemo] extra (~2 min on 2 cores).
- Bad input (no run config, another engine, no checkpoint, a slot file missing, a file holding another slice, an
  uneven pipeline split, an unknown or corrupt step, a checkpoint that is not a Llama, an out dir that is not
  empty) exits 2 with one message and no traceback (fast; no NeMo needed).

Run as a script (`python tests/test_export.py RUN_DIR TOKENS OUT STEP:EXPORT_DIR ...`) it computes the logits for
TOKENS (a safetensors file) and writes them to OUT (safetensors): no pickle crosses the process boundary.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from nemo_checkpointless.cli.export import main as export_main
from nemo_checkpointless.config import (
    Config,
    ModelConfig,
    ParallelConfig,
    ReplicationConfig,
    TrainerConfig,
    save_run_config,
)
from nemo_checkpointless.megatron.export import merge_slices
from nemo_checkpointless.state.checkpoint import CheckpointStore

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
STEPS = 3  # checkpoints at steps 1 and 2 (the last step ends the run before its boundary)
JOB_TIMEOUT_S = 300
TOLERANCE = 1e-4


# ------------------------------------------------------------------------------------------- the real export
@pytest.fixture(scope="module")
def nemo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harness import child_env

    run_dir = tmp_path_factory.mktemp("export") / "run"
    cmd = [sys.executable, "-m", "nemo_checkpointless.cli.train", f"run.dir={run_dir}", "recipe=tiny_llama_nemo",
           "launcher.preload=[nemo_shim]", f"trainer.max_steps={STEPS}", "checkpoint.every_n_steps=1",
           "trainer.devices=4", "parallel.tp=2", "parallel.pp=2", "replication.num_instances=1",
           "trainer.progress_bar=false",
           "launcher.collective_timeout_s=30"]
    proc = subprocess.run(cmd, env=child_env(tests_on_path=True), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=JOB_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stdout.decode(errors="replace")[-5000:]
    return run_dir


def _export(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed console script's module, in a process of its own (as a user runs it)."""
    return subprocess.run([sys.executable, "-m", "nemo_checkpointless.cli.export", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)


def _logits(run_dir: Path, tokens: Path, exports: dict[int, Path], out: Path) -> dict[str, torch.Tensor]:
    """The logits for the tokens, from one subprocess (this file as a script): `hf.<step>` from the export,
    `megatron.<step>` from megatron-core's sliced model holding that step's checkpoint files, `merged.<step>` from a
    TP=1 megatron model holding `merge_slices`' output."""
    from harness import child_env

    pairs = [f"{step}:{path}" for step, path in exports.items()]
    proc = subprocess.run([sys.executable, __file__, str(run_dir), str(tokens), str(out), *pairs],
                          env=child_env(tests_on_path=True), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=JOB_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stdout.decode(errors="replace")[-5000:]
    return safetensors.torch.load_file(out)


@pytest.mark.nemo
@pytest.mark.slow
@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
def test_export_loads_in_transformers_and_gives_megatrons_logits(nemo_run: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert CheckpointStore(nemo_run / "checkpoints", 4).steps() == [1, 2]  # 4 slots: TP 2 x PP 2
    exports = {2: tmp_path / "hf-2", 1: tmp_path / "hf-1"}
    proc = _export("--run-dir", str(nemo_run), "--out", str(exports[2]))  # the newest step
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"step 2 -> {exports[2]}" in proc.stdout, proc.stdout
    assert export_main(["--run-dir", str(nemo_run), "--step", "1", "--out", str(exports[1])]) == 0
    assert f"step 1 -> {exports[1]}" in capsys.readouterr().out
    for out in exports.values():
        assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
        assert stat.S_IMODE(out.stat().st_mode) == 0o700
        assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o600}
        config = json.loads((out / "config.json").read_text())
        assert config["num_key_value_heads"] == 2 and config["num_attention_heads"] == 4, config
    # The two steps are two different models (the comparison would not see a step mix-up otherwise).
    first, second = (safetensors.torch.load_file(exports[s] / "model.safetensors") for s in (1, 2))
    assert not torch.equal(first["model.layers.0.mlp.up_proj.weight"], second["model.layers.0.mlp.up_proj.weight"])

    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(7))
    safetensors.torch.save_file({"tokens": tokens}, tmp_path / "tokens.safetensors")
    logits = _logits(nemo_run, tmp_path / "tokens.safetensors", exports, tmp_path / "logits.safetensors")
    for step in exports:
        hf, megatron, merged = logits[f"hf.{step}"], logits[f"megatron.{step}"], logits[f"merged.{step}"]
        assert hf.shape == megatron.shape == merged.shape == (2, 48, 256)
        diff = (hf - megatron).abs().max().item()
        mapping = (hf - merged).abs().max().item()
        with capsys.disabled():
            print(f"\nstep {step}: max |logits(hf) - logits(megatron TP=2 x PP=2)| = {diff:.3g}, max |logits(hf) - "
                  f"logits(megatron TP=1, merged)| = {mapping:.3g} (max |logit| {megatron.abs().max().item():.3g})")
        assert diff < TOLERANCE and mapping < TOLERANCE, (diff, mapping)


# ------------------------------------------------------------------------------------------------ bad input
def _run_dir(tmp_path: Path, **kwargs: object) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True)
    options: dict[str, object] = dict(engine="nemo", trainer=TrainerConfig(devices=2),
                                      replication=ReplicationConfig(num_instances=1))
    options.update(kwargs)
    save_run_config(Config(**options), run_dir)  # type: ignore[arg-type]
    return run_dir


def _error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert export_main(list(args)) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert captured.err.startswith("checkpointless-export: "), captured.err
    return captured.err


def test_bad_input_gets_one_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "out")
    err = _error(capsys, "--run-dir", str(tmp_path), "--out", out)
    assert f"--run-dir={tmp_path}: holds no config.yaml" in err and "checkpointless-train" in err, err

    lightning = _run_dir(tmp_path / "lightning", engine="lightning")
    assert "is a run of engine=lightning" in _error(capsys, "--run-dir", str(lightning), "--out", out)

    run = _run_dir(tmp_path / "nemo")
    err = _error(capsys, "--run-dir", str(run), "--out", out)
    assert "has no checkpoint under" in err and "checkpoint.every_n_steps=N" in err, err

    # Two checkpoints of a model that is not the config's Llama (one tensor), one of them then corrupted.
    store = CheckpointStore(run / "checkpoints", 2)
    for step in (2, 4):
        for shard in (0, 1):
            store.save_shard(step, shard, {"model.0.module.module.embedding.word_embeddings.weight":
                                           torch.zeros(256, 128)}, {"step": step})
    err = _error(capsys, "--run-dir", str(run), "--step", "3", "--out", out)
    assert "--step=3: is not a checkpoint step of this run (it has 2, 4)" in err, err
    assert "--step=0: must be >= 1" in _error(capsys, "--run-dir", str(run), "--step", "0", "--out", out)
    err = _error(capsys, "--run-dir", str(run), "--out", out)
    assert "its checkpoint of step 4 is not a Llama this export knows" in err, err
    assert "has no decoder.layers.0.self_attention.linear_qkv.weight" in err, err
    shard = run / "checkpoints" / "step_00000004" / "shard_0.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1] + b"x")
    err = _error(capsys, "--run-dir", str(run), "--step", "4", "--out", out)
    assert "--step=4: the checkpoint of step 4 does not verify" in err and "pick another step (2)" in err, err

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    err = _error(capsys, "--run-dir", str(run), "--out", out)
    assert f"--out={out}: exists and is not an empty directory" in err, err
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")], "a temporary export was left"


def test_a_checkpoint_of_another_layout_gets_one_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "out")
    tensor = {"model.0.module.module.embedding.word_embeddings.weight": torch.zeros(128, 128)}
    # A TP=2 run (2 slots) whose step 2 has slot 0's file only, as a TP=1 run of 2 data-parallel ranks with
    # num_instances=2 would leave it; step 3 has both, but slot 1 holds TP rank 0's slice.
    run = _run_dir(tmp_path / "tp2", parallel=ParallelConfig(tp=2))
    store = CheckpointStore(run / "checkpoints", 2)
    store.save_shard(2, 0, tensor, {"step": 2, "tp_rank": 0, "pp_rank": 0, "shard_index": 0})
    err = _error(capsys, "--run-dir", str(run), "--out", out)
    assert "has no complete checkpoint under" in err and "step 2 lacks shard_1.safetensors, shard_1.json of the 2 " \
        "slot files" in err, err
    for slot in (0, 1):
        store.save_shard(3, slot, tensor, {"step": 3, "tp_rank": 0, "pp_rank": 0, "shard_index": 0})
    err = _error(capsys, "--run-dir", str(run), "--step", "2", "--out", out)
    assert "--step=2: is an incomplete checkpoint (it lacks shard_1.safetensors, shard_1.json of its 2" in err, err
    err = _error(capsys, "--run-dir", str(run), "--out", out)
    assert "its checkpoint does not match its config's layout (shard_1.safetensors of step 3 holds tp_rank=0, " \
        "pp_rank=0, shard_index=0; with parallel.tp=2, parallel.pp=1 and 1 data-parallel shard(s) per slice, slot 1 " \
        "is tp_rank=1, pp_rank=0, shard_index=0)" in err, err

    # PP=2 over 4 layers, but stage 0 holds 3 of them (an uneven split) and stage 1 one.
    uneven = _run_dir(tmp_path / "uneven", model=ModelConfig(n_layers=4), parallel=ParallelConfig(pp=2))
    store = CheckpointStore(uneven / "checkpoints", 2)
    for pp, layers in ((0, 3), (1, 1)):
        store.save_shard(1, pp, {f"{PREFIX}decoder.layers.{i}.input_layernorm.weight": torch.ones(128)
                                 for i in range(layers)}, {"step": 1, "tp_rank": 0, "pp_rank": pp, "shard_index": 0})
    err = _error(capsys, "--run-dir", str(uneven), "--out", out)
    assert "its checkpoint of step 1 is not a Llama this export knows (pipeline stage 0 holds layers [0, 1, 2]; an " \
        "even split of 4 layers over 2 stages gives it 2 (local 0 ... 1): uneven splits" in err, err
    assert not Path(out).exists()


def test_merge_slices_places_pipeline_stages_and_joins_tensor_parallel_slices() -> None:
    """Megatron's rules (module doc of megatron.export) on small made-up slices: PP=2 x TP=2, 4 layers, tied embedding
    (the last stage's copy of it is dropped); the e2e test above checks TP against megatron's own computation."""
    m = ModelConfig(n_layers=4, tie_embeddings=True)
    slices: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for tp in (0, 1):
        slices[tp, 0] = {"embedding.word_embeddings.weight": torch.full((3, 2), float(tp))}
        slices[tp, 1] = {"output_layer.weight": torch.full((3, 2), float(tp)),
                         "decoder.final_layernorm.weight": torch.ones(2)}
        for pp in (0, 1):
            for local in (0, 1):
                layer = f"decoder.layers.{local}."
                value = 10.0 * (2 * pp + local)  # the global layer
                slices[tp, pp] |= {
                    layer + "self_attention.linear_qkv.weight": torch.full((2, 2), value + tp),
                    layer + "mlp.linear_fc1.weight": torch.tensor([[value + tp], [value + tp + 0.5]]),  # gate; up
                    layer + "mlp.linear_fc2.weight": torch.full((2, 1), value + tp),
                    layer + "input_layernorm.weight": torch.full((2,), value)}
    merged = merge_slices(slices, m, tp=2, pp=2)
    assert "output_layer.weight" not in merged
    assert merged["embedding.word_embeddings.weight"][:, 0].tolist() == [0, 0, 0, 1, 1, 1]
    assert torch.equal(merged["decoder.final_layernorm.weight"], torch.ones(2))
    for layer in range(4):
        value, pre = 10.0 * layer, f"decoder.layers.{layer}."
        assert merged[pre + "self_attention.linear_qkv.weight"][:, 0].tolist() == [value] * 2 + [value + 1] * 2
        assert merged[pre + "mlp.linear_fc1.weight"][:, 0].tolist() == [value, value + 1, value + 0.5, value + 1.5]
        assert merged[pre + "mlp.linear_fc2.weight"].tolist() == [[value, value + 1]] * 2
        assert merged[pre + "input_layernorm.weight"].tolist() == [value] * 2
    assert len(merged) == 2 + 4 * 4

    slices[1, 1]["decoder.layers.0.input_layernorm.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"decoder.layers.0.input_layernorm.weight \(replicated over TP\) differs "
                                         r"between TP ranks 0 and 1 of pipeline stage 1"):
        merge_slices(slices, m, tp=2, pp=2)
    slices[1, 1]["decoder.layers.0.input_layernorm.weight"] = torch.full((2,), 20.0)
    slices[1, 1]["embedding.word_embeddings.weight"] = slices[0, 1]["embedding.word_embeddings.weight"] = \
        torch.zeros(3, 2)
    with pytest.raises(ValueError, match=r"embedding.word_embeddings.weight is on pipeline stage 1 of 2; megatron "
                                         "puts it on the first"):
        merge_slices(slices, m, tp=2, pp=2)


def test_console_script_exits_2_without_a_traceback(tmp_path: Path) -> None:
    proc = _export("--run-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("checkpointless-export: --run-dir="), proc.stderr
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ the script side
PREFIX = "model.0.module.module."


def _script_main(run_dir: Path, tokens_path: Path, out: Path, exports: dict[int, Path]) -> None:
    """Logits for the tokens of (1) `hf.<step>`: each export, loaded by transformers' own `from_pretrained`;
    (2) `megatron.<step>`: megatron-core's GPTModel as the NeMo worker builds it (`nemo.worker.build_model`), in the
    run's TP x PP layout: one forked gloo rank per slice, each loaded strictly with its slot's checkpoint file
    (`_slice_rank`); (3) `merged.<step>`: the same GPTModel at TP = PP = 1 on a one-rank group, loaded strictly with
    `export.merge_slices`' output. Transformers runs first, before the CPU shim."""
    from transformers import LlamaForCausalLM

    tokens = safetensors.torch.load_file(tokens_path)["tokens"]
    logits: dict[str, torch.Tensor] = {}
    for step, path in exports.items():
        model = LlamaForCausalLM.from_pretrained(path).eval()
        assert model.dtype == torch.float32, model.dtype
        with torch.no_grad():
            logits[f"hf.{step}"] = model(tokens).logits.contiguous()

    import nemo_shim

    nemo_shim.install()
    import multiprocessing

    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from nemo_checkpointless.config import load_run_config
    from nemo_checkpointless.megatron.export import read_slices
    from nemo_checkpointless.nemo.worker import build_model

    cfg = load_run_config(run_dir)
    dims = cfg.dims()
    store = CheckpointStore(run_dir / "checkpoints", dims.checkpoint_slots)
    # (2) first, before this process joins a process group of its own: forked ranks must not inherit one.
    with tempfile.TemporaryDirectory() as tmp:
        world = dims.tp * dims.pp
        context = multiprocessing.get_context("fork")
        ranks = [context.Process(target=_slice_rank, args=(rank, world, cfg, store, list(exports), tokens, tmp))
                 for rank in range(world)]
        for proc in ranks:
            proc.start()
        for proc in ranks:
            proc.join(JOB_TIMEOUT_S)
        assert [proc.exitcode for proc in ranks] == [0] * world, [proc.exitcode for proc in ranks]
        logits |= safetensors.torch.load_file(Path(tmp) / "sliced.safetensors")

    module = build_model(cfg)  # TP = PP = 1: the config's parallel sizes stay at their defaults, 1
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
        module.configure_model()
        gpt = module.module.eval()
        shapes = {name: p.shape for name, p in gpt.named_parameters()}
        for step in exports:
            merged = merge_slices(read_slices(store, step, dims), cfg.model, dims.tp, dims.pp)
            # The vocabulary rows beyond TP=1's padding (128) are TP's padding (128 x tp), never a token's.
            merged = {k: v[: shapes[k][0]] if k in shapes and v.dim() == 2 and v.shape[0] > shapes[k][0] else v
                      for k, v in merged.items()}
            gpt.load_state_dict(merged, strict=True)
            logits[f"merged.{step}"] = _forward(gpt, tokens).float().contiguous()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    safetensors.torch.save_file(logits, out)


def _forward(gpt: Any, tokens: torch.Tensor) -> torch.Tensor:
    """One forward pass of a megatron GPTModel (or of one pipeline stage of it)."""
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.ones(s, s).tril().view(1, 1, s, s) < 0.5  # True: masked (megatron's local attention)
    with torch.no_grad():
        result: torch.Tensor = gpt(input_ids=tokens, position_ids=positions, attention_mask=mask)
    return result


def _slice_rank(rank: int, world: int, cfg: Any, store: CheckpointStore, steps: list[int], tokens: torch.Tensor,
                tmp: str) -> None:
    """One rank of the run's TP x PP layout (forked): the worker's model for its slice, loaded strictly with its
    slot's file of each step; stages pass hidden states on by send/recv; the last stage's TP rank 0 writes the
    gathered (vocab-parallel) logits as `megatron.<step>` to TMP/sliced.safetensors."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from nemo_checkpointless.nemo.worker import build_model

    code = 1
    try:
        dims = cfg.dims()
        dist.init_process_group("gloo", init_method=f"file://{tmp}/group", rank=rank, world_size=world)
        parallel_state.initialize_model_parallel(dims.tp, dims.pp)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        module = build_model(cfg)
        # What NeMo's strategy sets on the model's config before building it (set_model_parallel_attributes).
        module.config.tensor_model_parallel_size = dims.tp
        module.config.pipeline_model_parallel_size = dims.pp
        module.config.pipeline_dtype = torch.float32
        module.configure_model()
        gpt = module.module.eval()
        slot = (pp_rank * dims.tp + tp_rank) * dims.shard_size
        logits = {}
        for step in steps:
            tensors, meta = store.load_shard(step, slot)
            assert (meta["tp_rank"], meta["pp_rank"]) == (tp_rank, pp_rank), meta
            gpt.load_state_dict({k[len(PREFIX):]: v for k, v in tensors.items() if k.startswith(PREFIX)},
                                strict=True)
            if pp_rank > 0:
                b, s = tokens.shape
                hidden = torch.empty(s, b, cfg.model.d_model)
                dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
                gpt.set_input_tensor(hidden)
            result = _forward(gpt, tokens)
            if pp_rank < dims.pp - 1:
                dist.send(result.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
            else:
                logits[f"megatron.{step}"] = tensor_parallel.gather_from_tensor_model_parallel_region(
                    result).float().contiguous()
        if logits and tp_rank == 0:
            safetensors.torch.save_file(logits, Path(tmp) / "sliced.safetensors")
        dist.barrier()
        code = 0
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no interpreter teardown: gloo's threads


if __name__ == "__main__":
    sys.path.insert(0, str(TESTS))
    _script_main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]),
                 {int(step): Path(path) for step, _, path in (a.partition(":") for a in sys.argv[4:])})
