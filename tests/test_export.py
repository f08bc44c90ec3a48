"""`checkpointless-export`: a NeMo run's persistent checkpoint as a Hugging Face Llama directory.

- A real `checkpointless-train recipe=tiny_llama_nemo` job (2 CPU ranks, checkpoints at steps 1 and 2) is exported
  (the newest step by default, and `--step 1`); `transformers.LlamaForCausalLM.from_pretrained` loads each export,
  and its logits on a fixed token batch equal, within 1e-4 (fp32; measured ~4e-7), those of megatron-core's own
  `GPTModel` built from the run's config and loaded with the same checkpoint's parameters (both in one subprocess:
  the CPU shim is process-wide). Skipped without the [nemo] extra (~60 s on 2 cores).
- Bad input (no run config, another engine, TP > 1, no checkpoint, an unknown or corrupt step, a checkpoint that is
  not a Llama, an out dir that is not empty) exits 2 with one message and no traceback (fast; no NeMo needed).

Run as a script (`python tests/test_export.py RUN_DIR TOKENS OUT STEP:EXPORT_DIR ...`) it computes both sides'
logits for TOKENS (a safetensors file) and writes them to OUT (safetensors): no pickle crosses the process boundary.
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from nemo_checkpointless.cli.export import main as export_main
from nemo_checkpointless.config import Config, ParallelConfig, ReplicationConfig, TrainerConfig, save_run_config
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
           "trainer.devices=2", "replication.num_instances=1", "trainer.progress_bar=false",
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
    """Both sides' logits for the tokens, from one subprocess (this file as a script): `hf.<step>` from the export,
    `megatron.<step>` from megatron-core holding that step's checkpoint."""
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
    assert CheckpointStore(nemo_run / "checkpoints", 2).steps() == [1, 2]
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
        hf, megatron = logits[f"hf.{step}"], logits[f"megatron.{step}"]
        assert hf.shape == megatron.shape == (2, 48, 256)
        diff = (hf - megatron).abs().max().item()
        with capsys.disabled():
            print(f"\nstep {step}: max |logits(hf) - logits(megatron)| = {diff:.3g} (max |logit| "
                  f"{megatron.abs().max().item():.3g})")
        assert diff < TOLERANCE, diff


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

    tp2 = _run_dir(tmp_path / "tp2", parallel=ParallelConfig(tp=2))
    err = _error(capsys, "--run-dir", str(tp2), "--out", out)
    assert "parallel.tp=2" in err and "export a run with parallel.tp=1 and parallel.pp=1" in err, err

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


def test_console_script_exits_2_without_a_traceback(tmp_path: Path) -> None:
    proc = _export("--run-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("checkpointless-export: --run-dir="), proc.stderr
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ the script side
def _script_main(run_dir: Path, tokens_path: Path, out: Path, exports: dict[int, Path]) -> None:
    """Logits for the tokens of (1) each export, loaded by transformers' own `from_pretrained`, and (2) megatron-core's
    GPTModel as the NeMo worker builds it (`nemo.worker.build_model`, on a one-rank gloo group) loaded with that
    step's checkpoint parameters (megatron's names, strict). Transformers runs first, before the CPU shim."""
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
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from nemo_checkpointless.config import load_run_config
    from nemo_checkpointless.nemo.worker import build_model

    cfg = load_run_config(run_dir)
    store = CheckpointStore(run_dir / "checkpoints", cfg.dims().checkpoint_slots)
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.ones(s, s).tril().view(1, 1, s, s) < 0.5  # True: masked (megatron's local attention)
    prefix = "model.0.module.module."
    module = build_model(cfg)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
        module.configure_model()
        gpt = module.module.eval()
        for step in exports:
            tensors, _ = store.load_shard(step, 0)
            gpt.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)},
                                strict=True)
            with torch.no_grad():
                logits[f"megatron.{step}"] = gpt(input_ids=tokens, position_ids=positions,
                                                 attention_mask=mask).float().contiguous()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    safetensors.torch.save_file(logits, out)


if __name__ == "__main__":
    sys.path.insert(0, str(TESTS))
    _script_main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]),
                 {int(step): Path(path) for step, _, path in (a.partition(":") for a in sys.argv[4:])})
