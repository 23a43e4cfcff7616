"""Claim C40: the gradient noise scale (the critical batch size) measured from the data
ranks (McCandlish et al. 2018, Appendix A.1; :mod:`labkit.train.noise_scale`).

The job's squared norms are checked against tests/oracle/'s independent model in one
process: each data rank's slice of the global batch gives ``|G_small|²`` (its mean token
loss's gradient), the whole batch ``|G_big|²``, at step 0 and after the oracle's own first
AdamW step. The estimator itself is checked for unbiasedness on draws with a known mean
and covariance."""
from __future__ import annotations

import math

import pytest
import torch
from oracle.model import forward
from oracle.run import initial_params, reference_run, token_groups

from labkit import jobs
from labkit.config import RunConfig
from labkit.models.data import make_batch
from labkit.train.noise_scale import EMA, estimates

CFG = RunConfig(steps=2, global_batch=8, micro_batch=1, bucket_mb=0.01, noise_scale=True,
                measure_memory=False, count_flops=False, adam_eps=1e-6).replace(dp=4)


def test_estimators_are_unbiased():
    """A.1's |G|² and tr(Σ) estimates average to the true values over many draws of
    per-sample gradients ``G + noise`` (noise covariance diag(σ²)); a small batch is the
    first ``b_small`` rows of the big one, as a data rank's slice is."""
    g = torch.Generator().manual_seed(0)
    d, trials, b_small, b_big = 16, 20000, 2, 8
    mean = torch.randn(d, generator=g, dtype=torch.float64) * 0.5
    sigma = torch.rand(d, generator=g, dtype=torch.float64) + 0.5
    samples = mean + sigma * torch.randn(trials, b_big, d, generator=g, dtype=torch.float64)
    small = samples[:, :b_small].mean(1).square().sum(1)
    big = samples.mean(1).square().sum(1)
    grad_sq, trace = estimates(small, big, b_small, b_big)
    truth_g, truth_tr = mean.square().sum().item(), sigma.square().sum().item()
    # standard errors of the means over 20000 trials are ~1% here
    assert grad_sq.mean().item() == pytest.approx(truth_g, rel=0.05)
    assert trace.mean().item() == pytest.approx(truth_tr, rel=0.05)
    with pytest.raises(ValueError, match="b_small"):
        estimates(small, big, b_big, b_big)


@pytest.mark.parametrize("change,match", [
    (dict(dp=1), "dp=1"), (dict(dp=2, zero_stage=2), "zero_stage=2"),
    (dict(dp=4, zero_stage=1, hsdp_replicas=2), "hsdp_replicas=2"),
    (dict(dp=2, impl="torch"), "PyTorch"), (dict(dp=2, tp=2), "tp=2"),
    (dict(dp=2, pp=2), "pp=2"), (dict(dp=2, cp=2), "cp=2"),
])
def test_refused_where_it_cannot_be_honoured(change, match):
    with pytest.raises(ValueError, match="noise_scale") as e:
        RunConfig(noise_scale=True).replace(**change).validate()
    assert e.match(match)


def _sq_norm(loss, params) -> float:
    grads = torch.autograd.grad(loss, params)
    return sum(torch.linalg.vector_norm(t, dtype=torch.float64).item() ** 2 for t in grads)


def _oracle_norms(cfg) -> tuple:
    """``(small, big)``: per step, each data rank's |G_small|² and |G_big|², the oracle's
    own forward on the rows the rank owns; step ``s`` at the oracle's weights after ``s``
    AdamW steps."""
    mc, dp = cfg.model_config, cfg.parallel.dp
    groups, n_groups = token_groups(cfg)
    rows = cfg.global_batch // dp
    small, big = [], []
    for s in range(cfg.steps):
        p = initial_params(cfg)
        if s:
            state = reference_run(cfg, steps=s)["state"]
            with torch.no_grad():
                for n, t in p.items():
                    t.copy_(state[n])
        params = list({id(t): t for t in p.values()}.values())  # a tied head once
        x, y = make_batch(cfg, s)
        big.append(_sq_norm(forward(p, mc, x, y, groups, n_groups)[0], params))
        small.append([_sq_norm(forward(p, mc, x[r * rows:(r + 1) * rows],
                                       y[r * rows:(r + 1) * rows], groups, n_groups)[0],
                               params) for r in range(dp)])
    return small, big


@pytest.mark.distributed
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_noise_scale_matches_oracle(cluster4, zero_stage):
    """C40: every rank's |G_small|² (its local gradient before the bucketed all-reduce or,
    at ZeRO 1, the reduce-scatter, accumulated over 2 microbatches) and |G_big|² (at ZeRO 1
    a sum of the ranks' shard norms) equal the oracle's at fp32 tolerance, at both steps;
    the mean over ranks, A.1's estimates and the smoothed B_simple follow."""
    cfg = CFG.replace(zero_stage=1, bucket_mb=RunConfig.bucket_mb) if zero_stage else CFG
    r = cluster4.run(jobs.train, cfg)
    small, big = _oracle_norms(CFG)
    assert len(r.metrics) == 4
    for rank, m in enumerate(r.metrics):
        ns = m["noise_scale"]
        assert (ns["b_small"], ns["b_big"]) == (2, 8)
        assert ns["g_small_sq"] == pytest.approx([s[rank] for s in small], rel=1e-5)
        assert ns["g_big_sq"] == pytest.approx(big, rel=1e-5)
        mean = [sum(s) / 4 for s in small]
        assert ns["g_small_sq_mean"] == pytest.approx(mean, rel=1e-5)
        # A.1 written out again here, on the oracle's numbers
        grad_sq = [(8 * g - 2 * s) / 6 for s, g in zip(mean, big)]
        trace = [(s - g) / (1 / 2 - 1 / 8) for s, g in zip(mean, big)]
        assert ns["grad_sq"] == pytest.approx(grad_sq, rel=1e-4)
        assert ns["trace_sigma"] == pytest.approx(trace, rel=1e-4)
        num = [(1 - EMA) * trace[0], EMA * (1 - EMA) * trace[0] + (1 - EMA) * trace[1]]
        den = [(1 - EMA) * grad_sq[0], EMA * (1 - EMA) * grad_sq[0] + (1 - EMA) * grad_sq[1]]
        want = [n / d if d > 0 else math.nan for n, d in zip(num, den)]
        assert ns["b_simple"] == pytest.approx(want, rel=1e-4, nan_ok=True)
    if zero_stage:
        return
    # the measurement adds no traffic to the step: C9's bytes exactly
    n = r.metrics[0]["n_params"]
    for rank in range(4):
        for step in range(2):
            assert r.trace.comm_bytes(rank, op="all_reduce", step=step) == 2 * 3 / 4 * n * 4
