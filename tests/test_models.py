"""Tests for labkit.models: GPT, ViT, parameter counts and deterministic local data."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from labkit.config import PRESETS, RunConfig
from labkit.models import (GPT, ViT, build_model, count_params, digits_batch, make_batch,
                           text_batch)
from labkit.models.gpt import Attention, Block, SwiGLU

TINY = PRESETS["tiny"]
SMALL = PRESETS["small"]
VIT = PRESETS["vit-digits"]


@pytest.fixture(autouse=True)
def _one_thread():
    # the CI box has 2 shared cores; intra-op threads fighting other jobs cost 10-30x
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() dedups tied weights


# ---------------------------------------------------------------- GPT structure & numerics

def test_gpt_shapes_and_attribute_names():
    model = build_model(TINY)
    assert isinstance(model, GPT)
    assert isinstance(model.tok_emb, torch.nn.Embedding) and len(model.layers) == 2
    blk = model.layers[0]
    assert isinstance(blk, Block) and isinstance(blk.attn, Attention)
    assert isinstance(blk.mlp, SwiGLU)
    assert blk.mlp.w1.weight.shape == blk.mlp.w3.weight.shape == (TINY.ffn_dim, 64)
    assert blk.mlp.w2.weight.shape == (64, TINY.ffn_dim)
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))
    x, _ = text_batch(0, 3, 16)
    assert model(x).shape == (3, 16, 256)
    assert set(model.state_dict()) == {n for n, _ in model.named_parameters()} | {"head.weight"}
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, TINY.seq_len + 1, dtype=torch.long))


def test_init_loss_is_uniform():
    model = build_model(TINY)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 256, (2, 8, TINY.seq_len), generator=g)
    loss = model(x, y)
    assert loss.dim() == 0
    assert abs(loss.item() - math.log(256)) < 0.05
    # on real text the tied head favours "next byte == this byte" (runs of spaces), so
    # the init loss sits a little below ln 256
    assert 4.9 < model(*text_batch(0, 8, TINY.seq_len)).item() < math.log(256) + 0.05


@pytest.mark.parametrize("cfg", [TINY, SMALL], ids=["mha", "gqa"])
def test_sdpa_matches_math(cfg):
    fast = build_model(cfg, attention="sdpa")
    slow = build_model(cfg, attention="math")
    x, _ = text_batch(1, 2, 32)
    torch.testing.assert_close(fast(x), slow(x), atol=1e-5, rtol=0)


def test_gqa_shapes_and_causality():
    model = build_model(SMALL)
    attn = model.layers[0].attn
    assert attn.wq.weight.shape == (128, 128)
    assert attn.wk.weight.shape == attn.wv.weight.shape == (2 * 32, 128)
    x, _ = text_batch(2, 2, 20)
    out = model(x)
    x2 = x.clone()
    x2[:, 10:] = (x2[:, 10:] + 1) % 256  # changing the future must not change the past
    torch.testing.assert_close(model(x2)[:, :10], out[:, :10])
    assert not torch.allclose(model(x2)[:, 10:], out[:, 10:])


def test_tied_and_untied():
    tied = build_model(TINY)
    assert tied.head.weight is tied.tok_emb.weight
    untied = build_model(dataclasses.replace(TINY, tie_embeddings=False))
    assert untied.head.weight is not untied.tok_emb.weight
    assert n_params(untied) - n_params(tied) == 256 * 64
    x, y = text_batch(0, 2, 8)
    untied(x, y).backward()
    assert untied.head.weight.grad is not None and untied.tok_emb.weight.grad is not None


def test_build_model_is_deterministic():
    a, b = build_model(TINY, seed=3), build_model(TINY, seed=3)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)
    # meta build + to_empty + reset_parameters reproduces the same weights, tie intact
    m = GPT(TINY, device="meta").to_empty(device="cpu")
    torch.manual_seed(3)
    m.reset_parameters()
    assert m.head.weight is m.tok_emb.weight and torch.equal(m.rope_cos, a.rope_cos)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), a.parameters()))
    c = build_model(TINY, seed=4)
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)
    std = a.layers[0].attn.wq.weight.std().item()
    assert 0.015 < std < 0.025 and torch.equal(a.norm.weight, torch.ones(64))


# ---------------------------------------------------------------- parameter counts

@pytest.mark.parametrize("name,expected", [("tiny", 123_200), ("small", 771_200),
                                           ("gpt2-124m", 151_862_784)])
def test_count_params_matches_built_model(name, expected):
    cfg = PRESETS[name]
    device = "meta" if name == "gpt2-124m" else "cpu"
    model = GPT(cfg, device=device)
    assert count_params(cfg) == n_params(model) == expected
    emb = cfg.vocab_size * cfg.d_model
    assert count_params(cfg, include_embeddings=False) == expected - emb


def test_count_params_untied_and_vit():
    cfg = dataclasses.replace(SMALL, tie_embeddings=False)
    assert count_params(cfg) == n_params(GPT(cfg))
    assert count_params(VIT) == n_params(ViT(VIT)) == 108_938


def test_llama3_counts():
    # Dubey et al. 2024 report 8B / 70B / 405B; exact ints from the formula
    assert count_params(PRESETS["llama3-8b"]) == 8_030_261_248
    assert count_params(PRESETS["llama3-70b"]) == 70_553_706_496
    assert count_params(PRESETS["llama3-405b"]) == 405_853_388_800
    with torch.device("meta"):
        model = GPT(PRESETS["llama3-8b"])
    assert model.tok_emb.weight.is_meta
    assert n_params(model) == 8_030_261_248


# ---------------------------------------------------------------- data

def test_text_batch_shift_determinism_and_splits():
    x, y = text_batch(5, 4, 32, seed=1)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (4, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, y2 = text_batch(5, 4, 32, seed=1)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, text_batch(6, 4, 32, seed=1)[0])
    assert not torch.equal(x, text_batch(5, 4, 32, seed=2)[0])
    assert not torch.equal(x, text_batch(5, 4, 32, seed=1, split="val")[0])
    with pytest.raises(ValueError, match="split"):
        text_batch(0, 1, 8, split="test")


@pytest.mark.parametrize("world", [2, 4])
def test_dp_slices_union_equals_global_batch(world):
    gb = 8
    gx, gy = text_batch(7, gb, 16, seed=3)
    per = gb // world
    # each rank computes the global batch independently and keeps its rows
    parts = [text_batch(7, gb, 16, seed=3)[0][r * per:(r + 1) * per] for r in range(world)]
    assert torch.equal(torch.cat(parts), gx)
    gi, gl = digits_batch(7, gb, seed=3)
    parts = [digits_batch(7, gb, seed=3)[1][r * per:(r + 1) * per] for r in range(world)]
    assert torch.equal(torch.cat(parts), gl)


def test_digits_batch_and_make_batch():
    imgs, labels = digits_batch(0, 16)
    assert imgs.shape == (16, 1, 8, 8) and imgs.dtype == torch.float32
    assert labels.shape == (16,) and labels.dtype == torch.int64
    assert 0.0 <= imgs.min() and imgs.max() <= 1.0 and imgs.max() > 0.5
    assert torch.equal(imgs, digits_batch(0, 16)[0])
    run = RunConfig(model="vit-digits", dataset="digits", global_batch=6, seed=2)
    i, t = make_batch(run, 3)
    assert torch.equal(i, digits_batch(3, 6, seed=2)[0]) and torch.equal(t, digits_batch(3, 6, seed=2)[1])
    run = RunConfig(model="tiny", global_batch=4, seed=2)
    x, y = make_batch(run, 1)
    assert x.shape == (4, TINY.seq_len) and torch.equal(x, text_batch(1, 4, 64, seed=2)[0])


# ---------------------------------------------------------------- ViT and training

def test_vit_shapes_and_errors():
    model = build_model(VIT)
    assert isinstance(model, ViT)
    assert all(not blk.attn.causal for blk in model.layers)
    imgs, labels = digits_batch(0, 5)
    assert model(imgs).shape == (5, 10)
    assert abs(model(imgs, labels).item() - math.log(10)) < 0.2
    with pytest.raises(ValueError, match="images"):
        model(torch.zeros(2, 3, 8, 8))
    with pytest.raises(ValueError, match="kind"):
        GPT(VIT)


def _train(model, batch_fn, steps=30, lr=3e-3):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        loss = model(*batch_fn(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return sum(losses[:3]) / 3, sum(losses[-3:]) / 3


def test_vit_learns_digits():
    first, last = _train(build_model(VIT), lambda s: digits_batch(s, 64))
    assert last < 0.75 * first, (first, last)  # ~2.31 -> ~1.30


def test_gpt_tiny_learns_text():
    first, last = _train(build_model(TINY), lambda s: text_batch(s, 8, 64))
    assert last < first - 1.0, (first, last)  # ~5.04 -> ~3.00
