"""labkit.plan: analytic memory and communication (pure arithmetic, no torch)."""
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.plan import (GB, busbw_factor, comm_bytes, dp_step_comm_bytes, model_state_bytes,
                         normalize_collective, sharded_state_bytes)


def test_plan_imports_without_torch():
    code = "import sys, labkit.plan; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def test_mixed_precision_adam_is_16_bytes_per_param_optimizer_75_percent():  # claim C10
    s = model_state_bytes(1, mixed_precision=True)
    assert s == {"parameters": 2, "gradients": 2, "optimizer": 12, "total": 16}
    assert s["optimizer"] / s["total"] == 0.75
    f = model_state_bytes(1, mixed_precision=False)
    assert f == {"parameters": 4, "gradients": 4, "optimizer": 8, "total": 16}


def test_plain_dp_7_5b_on_64_gpus_is_120_gb_per_gpu():  # claim C11
    s = model_state_bytes(7.5e9, n_ranks=64, zero_stage=0)
    assert s["total"] == pytest.approx(120 * GB)
    assert s["total"] > 80 * GB  # does not fit an 80 GB A100


def test_100b_params_4_values_2_bytes_on_80_gpus():  # claim C12
    s = sharded_state_bytes(100e9, values_per_param=4, bytes_per_value=2, n_ranks=80)
    assert s["total"] == pytest.approx(800 * GB)
    assert s["per_rank"] == pytest.approx(10 * GB)


@pytest.mark.parametrize("n", [1, 8, 64])
def test_zero_stages_match_the_paper(n):  # ZeRO paper §5.1 with K = 12
    psi = 7.5e9
    t = {k: model_state_bytes(psi, n, k)["total"] for k in range(4)}
    assert t[0] == pytest.approx(16 * psi)
    assert t[1] == pytest.approx(4 * psi + 12 * psi / n)
    assert t[2] == pytest.approx(2 * psi + 14 * psi / n)
    assert t[3] == pytest.approx(16 * psi / n)
    s1 = model_state_bytes(psi, n, 1)
    assert s1["parameters"] == 2 * psi and s1["optimizer"] == pytest.approx(12 * psi / n)


def test_zero_fp32_categories_stay_explicit():
    s = model_state_bytes(100, n_ranks=4, zero_stage=2, mixed_precision=False)
    assert s == {"parameters": 400, "gradients": 100, "optimizer": 200, "total": 700}


@pytest.mark.parametrize("kwargs", [dict(n_params=-1), dict(n_params=1, n_ranks=0),
                                    dict(n_params=1, zero_stage=4)])
def test_model_state_bytes_rejects_bad_input(kwargs):
    with pytest.raises(ValueError):
        model_state_bytes(**kwargs)


def test_ring_bytes_per_rank():  # claim C6
    S, N = 1000.0, 4
    assert comm_bytes("all_reduce", S, N) == pytest.approx(2 * 3 / 4 * S)
    for c in ("reduce_scatter", "all_gather", "all_to_all"):
        assert comm_bytes(c, S, N) == pytest.approx(3 / 4 * S)
    for c in ("broadcast", "reduce"):
        assert comm_bytes(c, S, N) == S
    assert comm_bytes("all_reduce", S, 1) == 0.0
    # all-reduce = reduce-scatter + all-gather (claim C5)
    assert comm_bytes("all_reduce", S, N) == pytest.approx(
        comm_bytes("reduce_scatter", S, N) + comm_bytes("all_gather", S, N))


def test_busbw_factors_as_nccl_tests():
    assert busbw_factor("allreduce", 8) == pytest.approx(1.75)
    assert busbw_factor("AllGather", 8) == pytest.approx(0.875)
    assert busbw_factor("reduce-scatter", 2) == pytest.approx(0.5)
    assert busbw_factor("broadcast", 8) == 1.0
    assert normalize_collective("all-to-all") == "all_to_all"
    with pytest.raises(ValueError, match="known"):
        busbw_factor("gossip", 4)
    with pytest.raises(ValueError):
        comm_bytes("all_reduce", 1.0, 0)


def test_dp_step_traffic_is_about_twice_theta_and_fsdp_three_times():  # C9, C13–C15
    n, N = 1e9, 1024
    theta = n * 2
    assert dp_step_comm_bytes(n, N, 2) == pytest.approx(2 * theta * (N - 1) / N)
    assert dp_step_comm_bytes(n, N, 2, zero_stage=1) == dp_step_comm_bytes(n, N, 2)
    fsdp = dp_step_comm_bytes(n, N, 2, zero_stage=3)
    assert fsdp / dp_step_comm_bytes(n, N, 2) == pytest.approx(1.5)
