"""Bad configs fail before launch with the field and the numbers (labkit.validate)."""
import pytest

from labkit.config import ModelConfig, RunConfig, preset

DEEP = ModelConfig(n_layers=4, d_model=32, n_heads=4, seq_len=16)


def _bad(match, world=4, **kw):
    with pytest.raises(ValueError, match=match):
        RunConfig(**{k: v for k, v in kw.items() if k not in ("dp", "tp", "pp", "cp", "ep")}
                  ).replace(**{k: v for k, v in kw.items()
                               if k in ("dp", "tp", "pp", "cp", "ep")}).validate(world)


@pytest.mark.parametrize("kw,match", [
    # the mesh
    (dict(global_batch=16, dp=8), r"dp x tp x pp x cp = 8 x 1 x 1 x 1 = 8 ranks but the "
                                  r"cluster has world_size=4"),
    (dict(dp=2, pp=4), r"= 8 ranks but the cluster has world_size=4"),
    (dict(zero_stage=3, dp=4, hsdp_replicas=3), r"hsdp_replicas=3 does not divide dp=4"),
    # the batch
    (dict(global_batch=10, micro_batch=4, dp=2), r"global_batch=10 is not divisible by dp x "
                                                 r"micro_batch = 2 x 4 = 8"),
    (dict(global_batch=6, dp=4), r"global_batch=6 is not divisible by dp=4"),
    (dict(global_batch=0), "global_batch must be an int >= 1, got 0"),
    (dict(pp=2, micro_batch=1, microbatches=3), r"microbatches=3 per flush does not divide "
                                                r"the 8 microbatches of a step"),
    # shapes and schedules
    (dict(pp=4, schedule="interleaved"), r"pp x virtual_stages = 4 x 2 = 8 stages but the "
                                         r"model has n_layers=2"),
    (dict(pp=4, model=ModelConfig(n_layers=3)), r"pp x virtual_stages = 4 x 1 = 4 stages but "
                                                r"the model has n_layers=3"),
    (dict(pp=2, schedule="zb-v", virtual_stages=3, model=DEEP), "runs 2 stage"),
    (dict(pp=2, schedule="warp"), "unknown schedule 'warp'"),
    (dict(checkpoint="every", checkpoint_every=3), r"checkpoint_every=3 must satisfy 1 <= C "
                                                   r"<= the 2 blocks of a stage"),
    # PyTorch's own schedule rules, checked here instead of on the ranks
    (dict(pp=4, impl="torch", micro_batch=4, model=DEEP), r"Schedule1F1B needs "
                                                          r"microbatches >= pp"),
    (dict(pp=2, impl="torch", schedule="zb-h1"), "impl='torch' runs gpipe, 1f1b"),
    # composition: fields a run cannot honour are refused, not ignored
    (dict(prefetch=False, dp=2), "prefetch=False has no effect here"),
    (dict(bucket_mb=1.0, dp=2, zero_stage=2), "bucket_mb=1.0 has no effect here"),
    (dict(schedule="gpipe"), "schedule='gpipe' has no effect here: .* pp=1"),
    (dict(hsdp_replicas=2, dp=2), "hsdp_replicas=2 has no effect here"),
    (dict(dp=2, pp=2, zero_stage=2, schedule="zb-h1"), "zero-bubble W pass"),
    (dict(dp=2, zero_stage=1, impl="torch"), "impl='torch' has no ZeRO-1"),
    (dict(dp=2, pp=2, impl="torch"), "ONE parallelism"),
    (dict(dp=2, zero_stage=3, compile=True), "compile=True with zero_stage=3"),
    # fields
    (dict(steps=0), "steps must be an int >= 1"), (dict(dp_mode="torch"), "impl='torch'"),
    (dict(lr=0.0), "lr must be a finite number > 0"),
    (dict(weight_decay=-1.0), "weight_decay must be"), (dict(seed=-1), "seed must be"),
    (dict(dataset="imagenet"), "dataset must be one of"),
    (dict(dataset="digits"), "does not fit model kind 'gpt'"),
    (dict(precision="fp8"), "precision must be one of"),
    (dict(zero_stage=4), "zero_stage must be 0, 1, 2 or 3, got 4"),
    (dict(bucket_mb=float("nan")), "bucket_mb must be a finite number"),
    (dict(model="gpt5"), "unknown model preset 'gpt5'.*tiny"),
    (dict(model="llama3-405b"), "planning and counting only"),
    (dict(model="vit-digits", dataset="digits", pp=2), "pipeline and expert parallelism are not built"),
    # context parallelism
    (dict(cp=2, cp_method="ulysses", model=ModelConfig(n_heads=2, n_kv_heads=1)),
     r"Ulysses: .*heads per tensor-parallel rank"),
    (dict(cp=3), r"sequence length|divisible"),
    (dict(cp=2, cp_method="spiral"), "cp_method must be one of"),
    (dict(cp_zigzag=False), "cp_zigzag=False has no effect here"),
])
def test_refused_before_launch_naming_the_numbers(kw, match):
    _bad(match, **kw)


def test_valid_configs_and_derived_sizes():
    cfg = RunConfig(global_batch=8, micro_batch=2).replace(dp=2)
    assert cfg.validate(4) is cfg
    assert (cfg.local_batch, cfg.micro, cfg.accum_steps) == (4, 2, 2)
    pipe = RunConfig(global_batch=8).replace(pp=2)  # default: M = 4 microbatches of 2
    assert (pipe.micro, pipe.flush_microbatches, pipe.flushes) == (2, 4, 1)
    two = RunConfig(global_batch=8, micro_batch=1, microbatches=4).replace(pp=2)
    assert (two.accum_steps, two.flush_microbatches, two.flushes) == (8, 4, 2)
    assert RunConfig(microbatches=8).replace(pp=2).micro == 1
    assert RunConfig().replace(dp=4, zero_stage=3, hsdp_replicas=2).mesh.shape == (1, 2, 2, 1, 1)
    assert RunConfig().replace(dp=4).mesh.dp_replicate == 4  # ZeRO 0: plain replicas


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("nope")


def test_cluster_validates_before_launch(cluster2):
    from labkit import jobs
    pids = cluster2.pids
    with pytest.raises(ValueError, match=r"= 4 ranks but the cluster has world_size=2"):
        cluster2.run(jobs.train, RunConfig().replace(dp=4))
    with pytest.raises(ValueError, match=r"100000 layers.*more than 90% of the"):
        cluster2.run(jobs.train, RunConfig(model=ModelConfig(n_layers=100000)).replace(pp=2))
    assert cluster2.pids == pids  # nothing was restarted


def test_public_names_are_listed_for_tab_completion():
    import labkit

    assert {"Cluster", "RunConfig", "jobs", "RankError"} <= set(dir(labkit))


def test_parallel_as_a_dict_is_stored_as_parallel_config():
    from labkit.config import ParallelConfig

    cfg = RunConfig(parallel=dict(dp=2, tp=2))
    assert cfg.parallel == ParallelConfig(dp=2, tp=2) and hash(cfg) == hash(cfg.replace())
    assert cfg.replace(parallel=dict(pp=2)).parallel == ParallelConfig(pp=2)
    assert cfg.replace(parallel=dict(pp=2), dp=2).parallel == ParallelConfig(dp=2, pp=2)
    with pytest.raises(TypeError, match="zz"):
        RunConfig(parallel=dict(zz=2))


@pytest.mark.parametrize("field,value", [("dp_mode", "naive"), ("bucket_mb", 1.0)])
def test_data_parallel_knobs_refused_with_one_data_rank(field, value):
    for par in (dict(), dict(pp=2), dict(tp=2)):
        with pytest.raises(ValueError, match=f"{field}=.*dp x cp = 1 x 1 = 1"):
            RunConfig(parallel=par, **{field: value}).validate()
    RunConfig(parallel=dict(cp=2), **{field: value}).validate()  # cp ranks reduce gradients
