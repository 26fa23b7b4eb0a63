"""Drafter and length head: training and serving forwards agree; bundles load only when sound."""

import json

import pytest
import torch

from dataplane.drafter import new_drafter
from dataplane.drafter_io import DrafterLoadError, load_bundle, save_bundle
from dataplane.spec_policy import paper_k_hat

IDENT = {"id": "tiny-llama", "sha256": "0" * 64}


@pytest.fixture(params=[False, True], ids=["kv-only", "recent-input"])
def drafter(tiny_target, request):
    d = new_drafter(tiny_target, seed=3, num_layers=2, n_target_layers=2, block_size=8, head_hidden=16,
                    recent_input=request.param)
    if d.recent_proj is not None:  # starts at zero; give the path weights so the tests exercise it
        torch.nn.init.normal_(d.recent_proj.weight, std=0.05, generator=torch.Generator().manual_seed(5))
    return d


def test_training_forward_equals_serving_forward(tiny_target, drafter):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 97, (40,), generator=g)
    layers = tuple(drafter.config.target_layers)
    hidden = tiny_target.forward_packed(tokens, [0, 40], [tiny_target.new_cache()], hidden_layers=layers).hidden
    anchors = torch.tensor([5, 17, 30])
    with torch.no_grad():
        train_h = drafter.forward_train(hidden, tokens, anchors)
    for i, p in enumerate(anchors.tolist()):
        kv = drafter.new_cache()
        drafter.extend_context(hidden[:p], [0, p], [kv])
        serve_h = drafter.forward_block(tokens[p : p + 1], [kv])
        assert torch.allclose(train_h[i], serve_h[0], atol=1e-5)
    if drafter.recent_proj is not None:  # the block reads the newest context feature, in both forwards
        kv.recent = torch.zeros_like(kv.recent)
        assert not torch.allclose(drafter.forward_block(tokens[p : p + 1], [kv])[0], serve_h[0], atol=1e-4)
        with torch.no_grad():
            drafter.recent_proj.weight.zero_()
            assert not torch.allclose(drafter.forward_train(hidden, tokens, anchors), train_h, atol=1e-4)


@pytest.mark.parametrize("budget", [65536, 60])  # 60: groups cut by the padded-position budget
def test_block_is_batched_per_request(tiny_target, drafter, monkeypatch, budget):
    from dataplane import packed_attention

    monkeypatch.setattr(packed_attention, "GROUP_POSITIONS", budget)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 97, (n,), generator=g) for n in (6, 19, 2, 11, 30, 7)]
    layers = tuple(drafter.config.target_layers)
    kvs, alone = [], []
    for s in seqs:
        h = tiny_target.forward_packed(s, [0, len(s)], [tiny_target.new_cache()], hidden_layers=layers).hidden
        kv = drafter.new_cache()
        drafter.extend_context(h, [0, len(s)], [kv])
        kvs.append(kv)
        alone.append(drafter.forward_block(s[-1:], [kv])[0])
    both = drafter.forward_block(torch.stack([s[-1] for s in seqs]), kvs)
    for i in range(len(seqs)):
        assert torch.allclose(both[i], alone[i], atol=1e-5)


def test_length_head_and_k_hat(drafter):
    h = torch.randn(5, drafter.config.block_size, drafter.config.hidden_size)
    a = drafter.length_head(h)
    assert a.shape == (5,) and bool(((a > 0) & (a < 1)).all())
    a_hat = [0.0, 0.05, 0.5, 0.99, 1.0]
    assert [paper_k_hat(a, 16, 1.0) for a in a_hat] == [1, 1, 8, 15, 16]
    assert [paper_k_hat(a, 16, 1.3) for a in a_hat] == [1, 1, 10, 16, 16]


def test_reduced_vocabulary_maps_back_to_target_ids(tiny_target, drafter):
    keep = torch.tensor([5, 9, 40, 96])
    drafter.set_vocab_map(keep)
    h = torch.randn(2, 3, drafter.config.hidden_size)
    logits = drafter.logits(h)
    assert logits.shape == (2, 3, 4)
    assert set(drafter.to_target_ids(logits.argmax(-1)).flatten().tolist()) <= set(keep.tolist())
    q = torch.softmax(logits, -1)
    full = drafter.expand_probs(q)
    assert full.shape == (2, 3, 97) and torch.allclose(full.sum(-1), torch.ones(2, 3))


def test_bundle_round_trip(tmp_path, tiny_target, drafter):
    drafter.set_vocab_map(torch.arange(50))
    manifest = save_bundle(drafter, tmp_path / "b", IDENT, version="7", lineage={"source": "offline"})
    loaded, m = load_bundle(tmp_path / "b", tiny_target, IDENT)
    assert m.version == "7" and m.files == manifest.files and m.block_size == 8
    h = torch.randn(1, 8, drafter.config.hidden_size)
    with torch.inference_mode():  # the loaded one serves its float32 products through the AVX2 kernel where it pays
        torch.testing.assert_close(loaded.logits(h), drafter.logits(h), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(loaded.length_head(h), drafter.length_head(h), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("damage", ["flip_byte", "nan", "wrong_target", "wrong_shape", "no_manifest", "pin"])
def test_bundle_refused_with_reason(tmp_path, tiny_target, drafter, damage):
    d = tmp_path / "b"
    save_bundle(drafter, d, IDENT)
    ident, pin = IDENT, None
    if damage == "flip_byte":
        raw = bytearray((d / "model.safetensors").read_bytes())
        raw[-3] ^= 0xFF
        (d / "model.safetensors").write_bytes(bytes(raw))
        expect = "sha256 mismatch"
    elif damage == "nan":
        state = drafter.state_dict()
        state["fc.weight"][0, 0] = float("nan")
        drafter.load_state_dict(state)
        save_bundle(drafter, d, IDENT)
        expect = "non-finite"
    elif damage == "wrong_target":
        ident = {"id": "other", "sha256": "1" * 64}
        expect = "trained for target"
    elif damage == "wrong_shape":
        cfg = json.loads((d / "config.json").read_text())
        cfg["num_layers"] = 3
        (d / "config.json").write_text(json.dumps(cfg))
        m = json.loads((d / "manifest.json").read_text())
        from adaflash.contracts.manifest import sha256_file

        m["files"]["config.json"] = sha256_file(d / "config.json")
        (d / "manifest.json").write_text(json.dumps(m))
        expect = "do not match the config"
    elif damage == "no_manifest":
        (d / "manifest.json").unlink()
        expect = "no manifest.json"
    else:
        pin = "f" * 64
        expect = "manifest sha256"
    with pytest.raises(DrafterLoadError, match=expect):
        load_bundle(d, tiny_target, ident, expected_sha256=pin)
