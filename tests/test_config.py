"""Bad configs fail before launch with the field and the numbers."""
import pytest

from labkit.config import RunConfig, preset


def test_dp_must_divide_ranks():
    with pytest.raises(ValueError, match=r"dp=3 does not divide .*world_size=4"):
        RunConfig(global_batch=12).replace(dp=3).validate(4)


def test_more_ranks_than_cluster():
    with pytest.raises(ValueError, match=r"need 8 ranks .*world_size=4"):
        RunConfig(global_batch=16).replace(dp=8).validate(4)


def test_batch_not_divisible():
    with pytest.raises(ValueError, match=r"global_batch=10 .* 2 x 4 = 8"):
        RunConfig(global_batch=10, micro_batch=4).replace(dp=2).validate(4)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown model preset 'gpt5'.*tiny"):
        RunConfig(model="gpt5").validate(4)
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("nope")


def test_count_only_preset_is_refused_for_training():
    with pytest.raises(ValueError, match="planning and counting only"):
        RunConfig(model="llama3-405b").validate(4)


@pytest.mark.parametrize("field,value,msg", [
    ("steps", 0, "steps must be"), ("dp_mode", "fsdp", "dp_mode"), ("bucket_mb", 0, "bucket_mb"),
    ("dataset", "imagenet", "dataset")])
def test_other_fields(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        RunConfig(**{field: value}).validate(4)


def test_valid_config_and_replace():
    cfg = RunConfig(global_batch=8, micro_batch=2).replace(dp=2)
    assert cfg.validate(4) is cfg
    assert (cfg.local_batch, cfg.micro, cfg.accum_steps) == (4, 2, 2)


def test_cluster_validates_before_launch(cluster2):
    from labkit import jobs
    pids = cluster2.pids
    with pytest.raises(ValueError, match="dp=4"):
        cluster2.run(jobs.train, RunConfig().replace(dp=4))
    assert cluster2.pids == pids  # nothing was restarted


@pytest.mark.parametrize("axis", ["tp", "pp", "cp"])
def test_other_axes_are_refused_by_the_dp_job(axis):
    with pytest.raises(ValueError, match=rf"{axis}=2: .*N-D composition is not available"):
        RunConfig(global_batch=8).replace(dp=2, **{axis: 2}).validate(4)


def test_zero_global_batch_message():
    with pytest.raises(ValueError, match="global_batch must be >= 1, got 0"):
        RunConfig(global_batch=0).validate(4)


def test_public_names_are_listed_for_tab_completion():
    import labkit

    assert {"Cluster", "RunConfig", "jobs", "RankError"} <= set(dir(labkit))
