"""Every recipe composes and validates; the published Llama sizes build on the meta device with the published
parameter counts; bad recipe/cluster combinations stop with one clear message before any process starts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from nemo_checkpointless.cli.compose import compose, recipe_names
from nemo_checkpointless.cli.train import main
from nemo_checkpointless.models import LlamaModel
from nemo_checkpointless.planning import total_params

# Published parameter counts (Meta's model cards), in billions.
HAVE_NEMO = importlib.util.find_spec("nemo") is not None
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

PUBLISHED_B = {
    "llama3_8b": 8.03,
    "llama31_8b": 8.03,
    "llama3_70b": 70.6,
    "llama31_70b": 70.6,
    "llama3_405b": 405.9,
    "llama32_1b": 1.24,
    "llama32_3b": 3.21,
}
EXPECTED_RECIPES = {*PUBLISHED_B, "tiny_llama_cpu", "tiny_llama_nemo"}


def test_the_recipes_exist() -> None:
    assert set(recipe_names()) >= EXPECTED_RECIPES


@pytest.mark.parametrize("name", sorted(EXPECTED_RECIPES))
def test_recipe_composes_validates_and_opens_with_its_launch_command(name: str) -> None:
    cfg = compose([f"recipe={name}"])
    assert cfg.recipe_name == name
    dims = cfg.dims()
    assert dims.dp_cp % cfg.replication.num_instances == 0
    text = (Path(__file__).resolve().parents[1] / "recipes" / f"{name}.yaml").read_text()
    head = "\n".join(text.splitlines()[:3])
    assert text.startswith("# Launch:"), name
    assert f"recipe={name}" in head or name == "tiny_llama_cpu", head  # the default recipe needs no recipe=
    assert "global batch" in text and "x DP" in text


@pytest.mark.parametrize("name", sorted(PUBLISHED_B))
def test_published_sizes_on_the_meta_device(name: str) -> None:
    cfg = compose([f"recipe={name}"])
    assert cfg.engine == "nemo" and cfg.trainer.accelerator == "gpu" and cfg.trainer.devices == 8
    with torch.device("meta"):
        model = LlamaModel(cfg.model.llama_config())
    count = model.num_parameters()
    assert model.embed.weight.is_meta
    assert count == total_params(cfg.model)  # the planner's closed form agrees with the module
    published = PUBLISHED_B[name] * 1e9
    assert abs(count - published) / published < 0.005, (name, count, published)


def test_llama_3_2_ties_embeddings_and_3_1_has_the_long_context() -> None:
    assert compose(["recipe=llama32_1b"]).model.tie_embeddings
    assert compose(["recipe=llama32_3b"]).model.tie_embeddings
    assert not compose(["recipe=llama3_8b"]).model.tie_embeddings
    assert compose(["recipe=llama31_70b"]).model.max_seq_len == 131072
    assert compose(["recipe=llama3_70b"]).model.max_seq_len == 8192


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # The example: 32 nodes x 8 GPUs / (tp 4 x cp 2 x pp 4) = dp 8, dp*cp = 16.
        (["recipe=llama3_70b", "replication.num_instances=3", "trainer.num_nodes=32"],
         ["replication.num_instances=3", "must divide the data-parallel size 16", "32 nodes x 8 devices",
          "choose 1, 2, 4, 8 or 16"]),
        (["recipe=llama3_70b", "trainer.num_nodes=3"],
         ["trainer.num_nodes=3", "24 ranks", "not a multiple of tp*cp*pp = 32", "trainer.num_nodes=4, 8, 12"]),
        (["recipe=llama3_405b", "parallel.cp=1", "trainer.num_nodes=10"],
         ["trainer.num_nodes=10", "tp*cp*pp = 72", "trainer.num_nodes=9, 18, 27"]),
        (["recipe=llama3_70b", "parallel.tp=16", "trainer.num_nodes=32"],
         ["model.n_kv_heads=8", "divisible by parallel.tp=16"]),
        (["recipe=llama3_70b", "parallel.pp=3", "trainer.num_nodes=12"], ["parallel.pp=3", "model.n_layers=80"]),
        (["recipe=llama4_70b"], ["recipe=llama4_70b", "no such recipe", "did you mean recipe=llama3_70b"]),
        (["recipe=llama3_70b", "engine=megatron"], ["engine=megatron", "lightning, nemo"]),
        (["recipe=llama3_70b", "trainer.precision=fp8"], ["trainer.precision=fp8", "bf16-mixed"]),
        # NeMo recipes validate, then must fit this machine (the local launcher; GPUs; NeMo; on CPU, a shim).
        (["recipe=llama3_70b"], ["trainer.num_nodes=16", "needs one agent per node", "launcher.target=slurm",
                                 "checkpointless-train recipe=llama3_70b trainer.num_nodes=16 launcher.node_rank=I"]),
        (["recipe=llama32_1b", "trainer.num_nodes=2"], ["trainer.num_nodes=2", "launcher.rdzv_endpoint=HOST:PORT"]),
        pytest.param(["recipe=llama32_1b"], ["trainer.devices=8", f"needs 8 CUDA GPUs, this machine has {GPUS}"],
                     marks=pytest.mark.skipif(GPUS >= 8, reason="this machine has 8 GPUs")),
        (["recipe=tiny_llama_nemo"],
         ["launcher.preload=[]", "PYTHONPATH=tests checkpointless-train recipe=tiny_llama_nemo launcher.preload="]
         if HAVE_NEMO else ["engine=nemo", "NeMo 2, which is not installed", "pip install -e '.[nemo]'"]),
        (["launcher.preload=[no_such_module_here]"], ["launcher.preload[0]=no_such_module_here", "PYTHONPATH"]),
        (["launcher.preload=[tests/nemo_shim.py]"], ["launcher.preload[0]=tests/nemo_shim.py", "module name"]),
        # The plain-Lightning path refuses what it does not implement.
        (["trainer.accumulate_grad_batches=4"], ["trainer.accumulate_grad_batches=4", "only"]),
        (["trainer.precision=bf16-mixed"], ["trainer.precision=bf16-mixed", "32-true"]),
    ],
)
def test_bad_recipe_input_is_one_clear_message(overrides: list[str], expected: list[str], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code = main([*overrides, f"run.dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("checkpointless-train: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in expected:
        assert fragment in err, (fragment, err)
    assert not any(tmp_path.iterdir()), "nothing may start on bad input"


def test_recipe_overrides_as_users_type_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cfg", "recipe=llama3_70b", "replication.num_instances=4", "trainer.num_nodes=32"]) == 0
    out = capsys.readouterr().out
    assert "num_instances: 4" in out and "num_nodes: 32" in out and "engine: nemo" in out
