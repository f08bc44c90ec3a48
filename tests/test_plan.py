"""`checkpointless-plan`: its memory and goodput arithmetic against values computed by hand (docs/planning.md)."""

from __future__ import annotations

import math

import pytest

from nemo_checkpointless.cli.compose import compose
from nemo_checkpointless.cli.plan import main
from nemo_checkpointless.planning import (
    GoodputInputs,
    padded_vocab,
    params_per_gpu,
    plan_memory,
    poisson_tail,
    recommend_spares,
    restart_baseline,
    with_spares,
)
from nemo_checkpointless.planning.goodput import FAILURES_PER_GPU_HOUR

GIB = 1 << 30

# Llama 3 70B at 16 nodes x 8 GPUs, tp=4 pp=4 cp=2 (sequence parallel), N=2, bf16-mixed, by hand:
#   one block's linear weights: q,o 2*8192*8192 + k,v 2*8192*1024 + SwiGLU 3*8192*28672 = 855,638,016
#   per tp rank: 855,638,016/4 + 2 norms 2*8192 = 213,925,888; 80/4 = 20 blocks = 4,278,517,760
#   vocab 128256 padded to a multiple of 128*4 = 512 -> 128,512; output layer 128,512*8192/4 = 263,192,576
#   last stage: 4,278,517,760 + final norm 8,192 + 263,192,576 = 4,541,718,528
P_R = 4_541_718_528
# dp = 128/32 = 4, dp*cp = 8, shard group S = 8/2 = 4.
PARAMS, GRADS = 2 * P_R, 4 * P_R  # 9,083,437,056 and 18,166,874,112
OPTIM = 12 * P_R // 4  # 13,625,155,584
OPTIM_ONE = 12 * P_R // 8  # 6,812,577,792 (N=1): the replica costs the same again
# activations: 4096 tokens per micro-batch per rank (8192/cp); per token (4*8192 + 2*8192 + 2*8*128 + 4*28672)/4
# = 41,472 elements x 2 B x 80 blocks; logits 4096 x 128,512/4 x (2 + 4) B.
ACT = 4096 * 41_472 * 2 * 80 + 4096 * 32_128 * 6  # 27,179,089,920 + 789,577,728


def test_memory_of_llama3_70b_at_16_nodes_by_hand() -> None:
    cfg = compose(["recipe=llama3_70b", "trainer.num_nodes=16"])
    assert padded_vocab(128256, 4) == 128_512 and padded_vocab(128256, 1) == 128_256
    assert params_per_gpu(cfg.model, 4, 4) == P_R
    mem = plan_memory(cfg)
    assert (mem.dp, mem.dp_cp, mem.num_instances, mem.shard_group) == (4, 8, 2, 4)
    assert (mem.params, mem.grads, mem.optimizer, mem.optimizer_one_instance) == (PARAMS, GRADS, OPTIM, OPTIM_ONE)
    assert mem.replication_extra == 6_812_577_792  # 12 B x (N-1)/(dp*cp) x P_r
    assert mem.activations == ACT
    assert mem.total == PARAMS + GRADS + OPTIM + ACT  # 59,664,966,784 B = 55.57 GiB
    assert mem.fits(80, 5) and not mem.fits(60, 5)


def test_replicas_scale_the_optimizer_state() -> None:
    one, four = (plan_memory(compose(["recipe=llama3_70b", "trainer.num_nodes=16", f"replication.num_instances={n}"]))
                 for n in (1, 4))
    assert one.optimizer == OPTIM_ONE and one.replication_extra == 0
    assert four.shard_group == 2 and four.optimizer == 12 * P_R // 2
    assert four.replication_extra == 12 * P_R * 3 // 8  # 12 B x (4-1)/8


def test_tied_embeddings_and_fp32_bytes() -> None:
    # Llama 3.2 1B, tp=pp=1: 128256*2048 (tied, once) + 16*(2*2048*2048 + 2*2048*512 + 3*2048*8192 + 2*2048) + 2048
    cfg = compose(["recipe=llama32_1b"])
    assert params_per_gpu(cfg.model, 1, 1) == 1_235_814_400
    # The tiny CPU recipe is fp32 (32-true): 4 B params + 4 B grads + Adam m, v 8 B over S = 4/2.
    tiny = plan_memory(compose([]))
    assert (tiny.params, tiny.grads, tiny.optimizer) == (4 * 434_816, 4 * 434_816, 8 * 434_816 // 2)


def test_goodput_by_hand() -> None:
    # 466 interruptions / (16,384 GPUs x 54 days x 24 h) = 2.195e-5 per GPU-hour; x 128 GPUs = 0.0028091 per hour.
    assert abs(FAILURES_PER_GPU_HOUR - 2.1946e-5) < 1e-9
    x = GoodputInputs(gpus=128, gpus_per_node=8)
    assert x.failures_per_hour == pytest.approx(0.00280912423, rel=1e-9)
    assert x.mtbf_h == pytest.approx(355.98283, rel=1e-6)
    # Young: T = sqrt(2 x 1/60 h x 355.98 h) = 3.4447 h; waste = C/T + lambda (T/2 + 0.25 h) = 1.0379 %.
    base = restart_baseline(x)
    assert base.checkpoint_interval_h == pytest.approx(3.4447198, rel=1e-6)
    assert base.goodput == pytest.approx(0.98962107, rel=1e-7)
    # No spare: every failure costs 60 s + a 600 s wait: 1 - 0.0028091 x 660/3600 = 0.999485.
    assert with_spares(x, 0).goodput == pytest.approx(0.99948499, rel=1e-7)
    # One spare node: busy with probability 1 - exp(-lambda x 2 h); held GPUs 128/136.
    one = with_spares(x, 1)
    assert one.p_wait == pytest.approx(1 - math.exp(-2 * 0.0028091242), rel=1e-7)
    assert one.goodput == pytest.approx(0.94112994, rel=1e-7)
    best, _ = recommend_spares(x)
    assert best.spares == 0  # a spare node would idle 6 % of the GPUs to save 0.05 %


def test_spares_pay_off_at_llama3_scale() -> None:
    # 16,384 GPUs: 0.3596 failures/h; a spare is busy for 2 h after each use (Poisson mean 0.719).
    x = GoodputInputs(gpus=16_384, gpus_per_node=8)
    assert poisson_tail(0, 0.72) == 1.0
    assert poisson_tail(1, 0.72) == pytest.approx(1 - math.exp(-0.72))
    assert poisson_tail(3, 0.72) == pytest.approx(1 - math.exp(-0.72) * (1 + 0.72 + 0.72**2 / 2))
    best, options = recommend_spares(x)
    assert best.spares == 4
    assert options[4].goodput > options[3].goodput and options[4].goodput > options[5].goodput
    assert best.goodput > restart_baseline(x).goodput


def test_plan_command_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipe=llama3_70b", "trainer.num_nodes=16"]) == 0
    out = capsys.readouterr().out
    for fragment in ("70.554 B parameters", "dp=4, dp*cp=8", "shard group 4", "8.46", "16.92", "12.69", "6.34",
                     "80 GB: fits; 141 GB: fits", "goodput 98.962%", "goodput 99.948%  <- recommended",
                     "replication.spares=0"):
        assert fragment in out, (fragment, out)


def test_plan_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipe=llama3_70b", "trainer.num_nodes=8", "--gpu-memory-gb", "40", "--failure-rate", "0",
                 "--recovery-s", "10"]) == 0
    out = capsys.readouterr().out
    assert "40 GB: does NOT fit" in out and "141" not in out and "goodput 100.000%" in out


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["recipe=llama3_70b", "replication.num_instances=3", "trainer.num_nodes=32"],
         "replication.num_instances=3: must divide the data-parallel size 16"),
        (["recipe=nope"], "recipe=nope: no such recipe"),
        (["recipe=llama3_70b", "--gpu-memory-gb", "0"], "--gpu-memory-gb=0.0: must be > 0"),
        (["recipe=llama3_70b", "--recovery-s", "-1"], "recovery_s=-1.0: must be >= 0"),
    ],
)
def test_plan_bad_input(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("checkpointless-plan: error: ") and expected in err and err.count("\n") == 1, err
