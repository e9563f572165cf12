"""Checkpoint loading: the real directory layouts (single file, shards with an index),
dtype choice, tied embeddings, and a clear error for each way a checkpoint can be bad."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from specdraft.loader import (
    Checkpoint,
    CheckpointError,
    load_causal_lm,
    load_eagle3_head,
    load_eagle_head,
)
from specdraft.models.config import UnsupportedModelError
from specdraft.models.tiny import (
    eagle_config,
    random_eagle3_weights,
    random_eagle_weights,
    random_weights,
    tiny_config,
    write_checkpoint,
)
from tests.model_helpers import PagedRunner, rel_err


def expected_params(cfg, w) -> dict:
    """Our parameter values from HF-named weights (fused q/k/v and gate/up)."""
    out = {
        "embed_tokens.weight": w["model.embed_tokens.weight"],
        "norm.weight": w["model.norm.weight"],
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        out[f"layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(
            [w[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"]
        )
        if cfg.qkv_bias:
            out[f"layers.{i}.self_attn.qkv_proj.bias"] = torch.cat(
                [w[f"{p}.self_attn.{x}_proj.bias"] for x in "qkv"]
            )
        out[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
            [w[f"{p}.mlp.gate_proj.weight"], w[f"{p}.mlp.up_proj.weight"]]
        )
        for name in (
            "self_attn.o_proj",
            "mlp.down_proj",
            "input_layernorm",
            "post_attention_layernorm",
        ):
            out[f"layers.{i}.{name}.weight"] = w[f"{p}.{name}.weight"]
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = w["lm_head.weight"]
    return out


@pytest.mark.parametrize("num_shards", [1, 3])
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_roundtrip_every_tensor(tmp_path, num_shards, model_type):
    cfg = tiny_config(model_type, num_layers=3)
    w = random_weights(cfg, seed=1)
    write_checkpoint(tmp_path, cfg, w, num_shards=num_shards)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (num_shards > 1)
    model = load_causal_lm(str(tmp_path))
    params = dict(model.named_parameters())
    expect = expected_params(cfg, w)
    assert set(params) == set(expect)
    for name, value in expect.items():
        assert torch.equal(params[name], value), name


@pytest.mark.interpreter
def test_written_checkpoint_loads_in_transformers(tmp_path):
    """write_checkpoint's layout is the real one: transformers reads it and agrees."""
    transformers = pytest.importorskip("transformers")
    cfg = tiny_config("qwen2", tie_word_embeddings=True)
    write_checkpoint(tmp_path, cfg, random_weights(cfg, seed=2), num_shards=2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ours = load_causal_lm(tmp_path)
    runner = PagedRunner(cfg, "cpu")
    prompt = [4, 8, 15, 16, 23, 42]
    meta = runner.step([(0, prompt)])
    _, logits = ours(meta.input_ids, meta, runner.cache)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    assert rel_err(logits[0], ref) < 1e-4


def test_dtype_choice_and_tied_embeddings(tmp_path):
    cfg = tiny_config("qwen2", tie_word_embeddings=True)
    w = random_weights(cfg, seed=3)
    assert "lm_head.weight" not in w
    write_checkpoint(tmp_path, cfg, w, dtype=torch.float16)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "float16"
    m = load_causal_lm(tmp_path)  # the config's dtype
    assert m.dtype == torch.float16 and m.embed_tokens.weight.dtype == torch.float16
    assert m.lm_head.weight is m.embed_tokens.weight
    assert m.rotary.cos_sin_cache.dtype == torch.float32
    for dtype, want in [
        ("bfloat16", torch.bfloat16),
        (torch.float32, torch.float32),
        ("auto", torch.float16),
    ]:
        assert load_causal_lm(tmp_path, dtype=dtype).norm.weight.dtype == want
    with pytest.raises(TypeError, match="dtype must be bfloat16, float16 or float32, got 'int8'"):
        load_causal_lm(tmp_path, dtype="int8")
    m = m.to(torch.float32)  # Module.to keeps the rotary table exact, in float32
    assert m.rotary.cos_sin_cache.dtype == torch.float32


def test_unused_tensors_are_reported(tmp_path, caplog):
    cfg = tiny_config(tie_word_embeddings=True)
    w = random_weights(cfg, seed=4)
    w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()  # tied: not read
    w["model.extra.weight"] = torch.zeros(3)
    write_checkpoint(tmp_path, cfg, w)
    with caplog.at_level(logging.WARNING):
        load_causal_lm(tmp_path)
    assert "2 checkpoint tensors unused" in caplog.text and "model.extra.weight" in caplog.text


def test_vllm_nested_eagle_config(tmp_path):
    """vLLM's EAGLE-1 conversions: {"model_type": "eagle", "model": {llama config}} and
    tensors under "model."."""
    cfg = eagle_config(tiny_config())
    w = {"model." + k: v for k, v in random_eagle_weights(cfg, with_embed=True).items()}
    w["lm_head.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size)
    nested = {"model_type": "eagle", "architectures": ["EAGLEModel"], "model": cfg.to_hf()}
    head = load_eagle_head(write_checkpoint(tmp_path, nested, w))
    assert head.cfg == cfg
    assert torch.equal(head.fc.weight, w["model.fc.weight"])


def test_load_draft_picks_the_kind(tmp_path):
    from specdraft.loader import load_draft
    from specdraft.models import Eagle3Head, EagleHead, LlamaForCausalLM

    path, cfg = _llama_dir(tmp_path / "lm")
    target = load_draft(path)
    assert isinstance(target, LlamaForCausalLM)
    h1 = eagle_config(cfg)
    e1 = write_checkpoint(tmp_path / "e1", h1, random_eagle_weights(h1))
    assert isinstance(load_draft(e1, target=target), EagleHead)
    h3 = eagle_config(cfg, draft_vocab_size=32)
    e3 = write_checkpoint(tmp_path / "e3", h3, random_eagle3_weights(h3))
    assert isinstance(load_draft(e3), Eagle3Head)


# ---- bad input: one clear error each ----------------------------------------------------


def _llama_dir(path, **cfg_kw):
    cfg = tiny_config(**cfg_kw)
    return write_checkpoint(path, cfg, random_weights(cfg, seed=5)), cfg


def _edit_config(path, **changes):
    f = path / "config.json"
    d = json.loads(f.read_text())
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    f.write_text(json.dumps(d))


def _drop_tensor(path, name):
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    del tensors[name]
    save_file(tensors, path / "model.safetensors")


def _case_missing_path(tmp_path):
    load_causal_lm(tmp_path / "nowhere")


def _case_file_not_dir(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"")
    load_causal_lm(tmp_path / "x.safetensors")


def _case_no_config(tmp_path):
    path, _ = _llama_dir(tmp_path)
    (path / "config.json").unlink()
    load_causal_lm(path)


def _case_bad_json(tmp_path):
    path, _ = _llama_dir(tmp_path)
    (path / "config.json").write_text("{not json")
    load_causal_lm(path)


def _case_no_safetensors(tmp_path):
    path, _ = _llama_dir(tmp_path)
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    load_causal_lm(path)


def _case_missing_shard(tmp_path):
    cfg = tiny_config()
    path = write_checkpoint(tmp_path, cfg, random_weights(cfg), num_shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    load_causal_lm(path)


def _case_missing_tensor(tmp_path):
    path, _ = _llama_dir(tmp_path)
    _drop_tensor(path, "model.layers.1.mlp.up_proj.weight")
    load_causal_lm(path)


def _case_missing_lm_head(tmp_path):
    path, _ = _llama_dir(tmp_path)
    _drop_tensor(path, "lm_head.weight")
    load_causal_lm(path)


def _case_shape_mismatch(tmp_path):
    path, _ = _llama_dir(tmp_path)
    _edit_config(path, intermediate_size=100)
    load_causal_lm(path)


def _case_vocab_mismatch(tmp_path):
    path, _ = _llama_dir(tmp_path)
    _edit_config(path, vocab_size=300)
    load_causal_lm(path)


def _case_unsupported_architecture(tmp_path):
    path, _ = _llama_dir(tmp_path)
    _edit_config(path, architectures=["MistralForCausalLM"], model_type="mistral")
    load_causal_lm(path)


def _case_unsupported_model_type(tmp_path):
    path, _ = _llama_dir(tmp_path)
    _edit_config(path, architectures=None, model_type="gemma")
    load_causal_lm(path)


def _case_unsupported_rope(tmp_path):
    path, _ = _llama_dir(tmp_path)
    _edit_config(path, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    load_causal_lm(path)


def _case_unsupported_activation(tmp_path):
    path, _ = _llama_dir(tmp_path)
    _edit_config(path, hidden_act="gelu")
    load_causal_lm(path)


def _case_config_lacks_field(tmp_path):
    path, _ = _llama_dir(tmp_path)
    _edit_config(path, num_hidden_layers=None)
    load_causal_lm(path)


def _case_eagle1_on_llama_dir(tmp_path):
    path, _ = _llama_dir(tmp_path)
    load_eagle_head(path)


def _case_eagle1_without_target(tmp_path):
    cfg = eagle_config(tiny_config())
    load_eagle_head(write_checkpoint(tmp_path, cfg, random_eagle_weights(cfg)))


def _case_eagle1_on_eagle3_dir(tmp_path):
    cfg = eagle_config(tiny_config(), draft_vocab_size=50)
    load_eagle_head(write_checkpoint(tmp_path, cfg, random_eagle3_weights(cfg)))


def _case_eagle3_on_eagle1_dir(tmp_path):
    cfg = eagle_config(tiny_config())
    load_eagle3_head(write_checkpoint(tmp_path, cfg, random_eagle_weights(cfg)))


def _case_eagle3_without_embedding(tmp_path):
    cfg = eagle_config(tiny_config(), draft_vocab_size=50)
    load_eagle3_head(write_checkpoint(tmp_path, cfg, random_eagle3_weights(cfg, with_embed=False)))


def _case_eagle3_without_d2t(tmp_path):
    cfg = eagle_config(tiny_config(), draft_vocab_size=50)
    w = random_eagle3_weights(cfg)
    del w["d2t"]
    load_eagle3_head(write_checkpoint(tmp_path, cfg, w))


def _case_eagle3_bad_fc(tmp_path):
    cfg = eagle_config(tiny_config(), draft_vocab_size=50)
    w = random_eagle3_weights(cfg)
    w["fc.weight"] = w["fc.weight"][:, :128]  # 2h wide, as if EAGLE-1
    load_eagle3_head(write_checkpoint(tmp_path, cfg, w))


BAD = [
    (_case_missing_path, CheckpointError, r"nowhere' does not exist"),
    (_case_file_not_dir, CheckpointError, r"x.safetensors' is not a directory"),
    (_case_no_config, CheckpointError, "has no config.json"),
    (_case_bad_json, CheckpointError, "config.json is not valid JSON"),
    (_case_no_safetensors, CheckpointError, r"no \*.safetensors files \(found \['pytorch_model"),
    (_case_missing_shard, CheckpointError, r"missing from .*model-00002-of-00002"),
    (_case_missing_tensor, CheckpointError, r"no tensor 'model.layers.1.mlp.up_proj.weight'"),
    (_case_missing_lm_head, CheckpointError, r"no tensor 'lm_head.weight'"),
    (
        _case_shape_mismatch,
        CheckpointError,
        r"gate_proj.weight' in .*model.safetensors has shape \(96, 64\), expected \(100, 64\)"
        r".*intermediate_size 100",
    ),
    (_case_vocab_mismatch, CheckpointError, r"embed_tokens.weight.*expected \(300, 64\)"),
    (
        _case_unsupported_architecture,
        UnsupportedModelError,
        r"\['MistralForCausalLM'\] is not supported; supported: LlamaForCausalLM, Qwen2ForCausalLM",
    ),
    (_case_unsupported_model_type, UnsupportedModelError, r"'gemma'.*supported: LlamaForCausalLM"),
    (_case_unsupported_rope, UnsupportedModelError, r"rope type 'yarn' is not supported"),
    (_case_unsupported_activation, UnsupportedModelError, r"hidden_act 'gelu'"),
    (_case_config_lacks_field, ValueError, r"config.json lacks num_hidden_layers"),
    (_case_eagle1_on_llama_dir, CheckpointError, "no fc.weight: not an EAGLE-1 checkpoint"),
    (_case_eagle1_without_target, CheckpointError, "no lm_head.weight.*pass target="),
    (_case_eagle1_on_eagle3_dir, CheckpointError, "holds an EAGLE-3 head.*load_eagle3_head"),
    (_case_eagle3_on_eagle1_dir, CheckpointError, "not an EAGLE-3 checkpoint"),
    (_case_eagle3_without_embedding, CheckpointError, "no embed_tokens.weight: pass target="),
    (_case_eagle3_without_d2t, CheckpointError, "no d2t tensor"),
    (_case_eagle3_bad_fc, CheckpointError, r"'fc.weight' in .*\(64, 128\), expected \(64, 192\)"),
]


@pytest.mark.parametrize("make, exc, words", BAD, ids=[b[0].__name__[6:] for b in BAD])
def test_bad_checkpoints(tmp_path, make, exc, words):
    with pytest.raises(exc, match=words):
        make(tmp_path)


def test_in_memory_checkpoint_checks_before_copying():
    cfg = tiny_config()
    w = random_weights(cfg, seed=6)
    model = load_causal_lm(Checkpoint.from_tensors(cfg.to_hf(), w))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    w["model.norm.weight"] = torch.ones(5)
    from specdraft.loader import load_weights

    with pytest.raises(CheckpointError, match="model.norm.weight"):
        load_weights(model, model.weight_sources(), Checkpoint.from_tensors(cfg.to_hf(), w))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "nothing copied"
