"""The model runner owns device and precision of target and drafter, and the serving step
hands the verify stream to the Triton kernels where they run (CUDA, or the interpreter)."""

from __future__ import annotations

import pytest
import torch

from adaflash.config import load_config
from dataplane import kernels
from dataplane.drafter import new_drafter
from dataplane.drafter_io import load_bundle, save_bundle
from dataplane.node import Node
from dataplane.runner import DeviceUnavailable, ModelRunner, resolve_device
from dataplane.target_cache import target_identity
from tests.dataplane.engine_util import make_engine, prompts, run

HAS_CUDA = torch.cuda.is_available()


def _settings(tmp_path, tiny_dir, **model):
    s = load_config(home=tmp_path / "home")
    s.model.path = str(tiny_dir)
    for k, v in model.items():
        setattr(s.model, k, v)
    return s


def test_device_setting_resolves_or_refuses_clearly():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if HAS_CUDA else "cpu")
    if HAS_CUDA:
        assert resolve_device("cuda").type == "cuda"
    else:
        with pytest.raises(DeviceUnavailable, match="no CUDA device is visible"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        resolve_device("tpu")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_target_and_drafter_follow_the_runner(tmp_path, tiny_dir, tiny_target, dtype):
    runner = ModelRunner.serving(_settings(tmp_path, tiny_dir, device="cpu", dtype=dtype))
    assert (runner.device, runner.precision) == (torch.device("cpu"), dtype)
    assert runner.describe()["verify_kernels"] == "torch"
    target = runner.load_target(tiny_dir)
    assert {p.dtype for p in target.parameters()} == {runner.dtype}
    bundle = tmp_path / "d"
    save_bundle(new_drafter(tiny_target, seed=1, num_layers=1, n_target_layers=2, block_size=8), bundle,
                target_identity(tiny_dir), version="v1")
    drafter, _ = load_bundle(bundle, target, target_identity(tiny_dir))  # a float32 bundle, placed
    floats = {p.dtype for p in drafter.parameters() if p.is_floating_point()}
    assert floats == {runner.dtype} and drafter.vocab_map.dtype == torch.int64
    assert ModelRunner.of(target) == ModelRunner(runner.device, runner.dtype, "the target's")
    assert ModelRunner.training().precision == "float32"


def test_node_on_a_missing_device_refuses_to_start(tmp_path, tiny_dir):
    if HAS_CUDA:
        node = Node(_settings(tmp_path, tiny_dir, device="cuda", dtype="auto"))
        assert node.runner.device.type == "cuda" and node.runner.precision == "bfloat16"
        return
    with pytest.raises(DeviceUnavailable, match="set model.device to auto or cpu"):
        Node(_settings(tmp_path, tiny_dir, device="cuda"))


@pytest.mark.skipif(not kernels.HAS_TRITON, reason="needs triton (the interpreter runs its kernels on CPU)")
def test_serving_step_runs_the_triton_kernels(tiny_target, monkeypatch):
    """Forced onto the Triton kernels (the interpreter on CPU; what CUDA tensors select), the
    engine's greedy and seeded requests emit exactly what the torch references give."""
    drafter = new_drafter(tiny_target, seed=7, num_layers=1, n_target_layers=2, block_size=8)
    ps = prompts(4, 97, seed=3)

    def both():
        greedy = run(make_engine(tiny_target, "fixed", drafter), ps, max_tokens=12)
        seeded = run(make_engine(tiny_target, "fixed", drafter), ps, max_tokens=12, temperature=0.8, seed=11)
        return [s.output_ids for s in greedy + seeded]

    reference = both()
    calls = {"pack": 0, "greedy": 0}
    pack, greedy = kernels.pack_drafts_triton, kernels.greedy_accept_triton
    monkeypatch.setattr(kernels, "pack_drafts_triton",
                        lambda *a: calls.__setitem__("pack", calls["pack"] + 1) or pack(*a))
    monkeypatch.setattr(kernels, "greedy_accept_triton",
                        lambda *a: calls.__setitem__("greedy", calls["greedy"] + 1) or greedy(*a))
    monkeypatch.setenv(kernels.FORCE_TRITON_ENV, "1")
    assert both() == reference
    assert calls["pack"] > 0 and calls["greedy"] > 0


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_engine_is_lossless(tiny_dir):
    """On CUDA (bfloat16, Triton kernels) speculative greedy output equals ar's."""
    runner = ModelRunner(torch.device("cuda"), torch.bfloat16)
    target = runner.load_target(tiny_dir)
    drafter = new_drafter(target, seed=7, num_layers=1, n_target_layers=2, block_size=8)
    ps = prompts(8, 97, seed=5)
    ar = [s.output_ids for s in run(make_engine(target, "ar", batch_invariant=True), ps, max_tokens=16)]
    spec = run(make_engine(target, "fixed", drafter, batch_invariant=True), ps, max_tokens=16)
    assert [s.output_ids for s in spec] == ar
    sampled = run(make_engine(target, "adaptive", drafter), ps, max_tokens=16, temperature=0.9)
    assert all(len(s.output_ids) == 16 for s in sampled)
