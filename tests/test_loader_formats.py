"""Loader refusals: quantized checkpoints by format, malformed files and config fields by
file and field, and bad arguments by name. Each case here failed or passed silently
before the loader checked it (a raw AttributeError / SafetensorError / KeyError, a
message without the file, or a quantized tensor cast to float)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdraft.loader import (
    Checkpoint,
    CheckpointError,
    load_causal_lm,
    load_draft,
    load_eagle3_head,
)
from specdraft.models.config import UnsupportedModelError
from specdraft.models.tiny import (
    eagle_config,
    random_causal_lm,
    random_eagle3_weights,
    random_weights,
    tiny_config,
    write_checkpoint,
)

SUPPORTED = "supported: unquantized float16/bfloat16/float32 safetensors"
Q = "model.layers.0.self_attn.q_proj"


def _write(path, cfg=None, tensors=None, **config_changes):
    """A tiny Llama checkpoint written without casting (so int8 / fp8 tensors stay so),
    config.json edited by `config_changes` (None removes a key)."""
    cfg = cfg or tiny_config()
    d = cfg.to_hf()
    for k, v in config_changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return write_checkpoint(path, d, random_weights(cfg, seed=7) if tensors is None else tensors)


def _weights(**changes):
    w = random_weights(tiny_config(), seed=7)
    w.update(changes)
    return w


# ---- 1. quantized checkpoints are refused by format --------------------------------------


@pytest.mark.parametrize(
    "qc, fmt",
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "gptq"),
        ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "awq"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
        ({"load_in_8bit": True}, "bitsandbytes"),  # transformers < 4.30: no quant_method
        ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "compressed-tensors"),
    ],
)
def test_config_quantization_is_refused(tmp_path, qc, fmt):
    path = _write(tmp_path, quantization_config=qc)
    with pytest.raises(ValueError) as e:
        load_causal_lm(path)
    msg = str(e.value)
    assert f"checkpoint {path} uses quantization '{fmt}'" in msg
    assert "config.json quantization_config" in msg and SUPPORTED in msg


def test_config_quantization_refused_for_heads_and_in_memory(tmp_path):
    hcfg = eagle_config(tiny_config(), draft_vocab_size=50)
    d = hcfg.to_hf() | {"quantization_config": {"quant_method": "fp8"}}
    path = write_checkpoint(tmp_path, d, random_eagle3_weights(hcfg))
    for load in (load_eagle3_head, load_draft):
        with pytest.raises(ValueError, match=r"uses quantization 'fp8' \(config.json quant"):
            load(path)
    ckpt = Checkpoint.from_tensors(
        tiny_config().to_hf() | {"compression_config": {"quant_method": "compressed-tensors"}},
        random_weights(tiny_config()),
    )
    with pytest.raises(ValueError, match="'compressed-tensors' .config.json compression_config"):
        load_causal_lm(ckpt)


def test_autogptq_quantize_config_file_is_refused(tmp_path):
    path = _write(tmp_path)
    (path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128}))
    with pytest.raises(CheckpointError, match=r"uses quantization 'gptq' \(.*quantize_config.json"):
        load_causal_lm(path)


def test_gptq_tensors_are_refused_by_format_not_as_missing(tmp_path):
    """GPTQ / AWQ store q_proj.qweight (int32) instead of q_proj.weight; the refusal
    names the format, not a missing q_proj.weight."""
    w = _weights()
    del w[f"{Q}.weight"]
    w[f"{Q}.qweight"] = torch.zeros(8, 64, dtype=torch.int32)
    w[f"{Q}.qzeros"] = torch.zeros(1, 8, dtype=torch.int32)
    w[f"{Q}.scales"] = torch.ones(1, 64, dtype=torch.float16)
    path = _write(tmp_path, tensors=w)
    with pytest.raises(CheckpointError) as e:
        load_causal_lm(path)
    msg = str(e.value)
    assert "uses quantization 'gptq/awq'" in msg and f"{Q}.q" in msg  # qweight or qzeros
    assert str(path / "model.safetensors") in msg and SUPPORTED in msg


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_weights_with_scales_are_refused(tmp_path, fp8):
    w = _weights()
    w[f"{Q}.weight"] = w[f"{Q}.weight"].to(fp8)
    w[f"{Q}.weight_scale"] = torch.ones(())
    w[f"{Q}.input_scale"] = torch.ones(())
    path = _write(tmp_path, tensors=w)
    with pytest.raises(CheckpointError) as e:
        load_causal_lm(path)
    msg = str(e.value)
    assert "uses quantization 'fp8'" in msg and f"{Q}.input_scale" in msg
    assert str(path / "model.safetensors") in msg


def test_block_fp8_weight_scale_inv_is_refused(tmp_path):
    """DeepSeek-style block fp8: weight_scale_inv beside the fp8 weight."""
    w = _weights()
    w[f"{Q}.weight"] = w[f"{Q}.weight"].to(torch.float8_e4m3fn)
    w[f"{Q}.weight_scale_inv"] = torch.ones(1, 1)
    with pytest.raises(CheckpointError, match=r"'fp8' \(tensor '.*q_proj.weight_scale_inv'"):
        load_causal_lm(_write(tmp_path, tensors=w))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_weights_without_scales_are_refused_by_dtype(tmp_path, fp8):
    w = _weights()
    w[f"{Q}.weight"] = w[f"{Q}.weight"].to(fp8)
    path = _write(tmp_path, tensors=w)
    name = str(fp8).removeprefix("torch.")
    with pytest.raises(CheckpointError) as e:
        load_causal_lm(path)
    msg = str(e.value)
    assert f"uses quantization 'fp8' (tensor '{Q}.weight' in {path / 'model.safetensors'}" in msg
    assert f"has dtype {name}" in msg and SUPPORTED in msg


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32])
def test_integer_weights_are_refused_by_dtype_name(tmp_path, dtype):
    w = _weights()
    w["model.layers.1.mlp.down_proj.weight"] = torch.ones(64, 96, dtype=dtype)
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(CheckpointError) as e:
        load_causal_lm(_write(tmp_path, tensors=w))
    msg = str(e.value)
    assert f"uses quantization '{name}'" in msg and f"has dtype {name}" in msg
    assert "model.layers.1.mlp.down_proj.weight" in msg


def test_int8_weights_in_memory_and_bool_weights_are_refused():
    cfg = tiny_config()
    w = _weights(**{"model.norm.weight": torch.ones(64, dtype=torch.int8)})
    with pytest.raises(CheckpointError, match=r"'int8' \(tensor 'model.norm.weight' in <in-mem"):
        load_causal_lm(Checkpoint.from_tensors(cfg.to_hf(), w))
    w["model.norm.weight"] = torch.ones(64, dtype=torch.bool)
    with pytest.raises(CheckpointError, match="model.norm.weight' .*has dtype bool"):
        load_causal_lm(Checkpoint.from_tensors(cfg.to_hf(), w))


def test_w8a8_int8_with_weight_scale_names_int8(tmp_path):
    """compressed-tensors' int8 scheme uses fp8's scale names; the weight's dtype tells."""
    w = _weights()
    w[f"{Q}.weight"] = torch.ones(64, 64, dtype=torch.int8)
    w[f"{Q}.weight_scale"] = torch.ones(64, 1)
    with pytest.raises(
        CheckpointError, match=r"uses quantization 'int8' \(tensor '.*weight_scale'"
    ):
        load_causal_lm(_write(tmp_path, tensors=w))


def test_bitsandbytes_tensors_are_refused(tmp_path):
    w = _weights()
    w[f"{Q}.weight"] = torch.ones(64, 64, dtype=torch.int8)
    w[f"{Q}.SCB"] = torch.ones(64)
    with pytest.raises(CheckpointError, match=r"'bitsandbytes' \(tensor '.*q_proj.SCB' in "):
        load_causal_lm(_write(tmp_path, tensors=w))


def test_float64_weights_still_load(tmp_path):
    """float64 is not a quantized format: it casts down like float32."""
    w = {k: v.double() for k, v in _weights().items()}
    model = load_causal_lm(_write(tmp_path, tensors=w), dtype="float32")
    assert torch.equal(model.norm.weight, w["model.norm.weight"].float())


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_each_of_q_k_v_is_checked_not_only_their_total(tmp_path, model_type):
    """q 64 rows, k and v 32 each (4 heads, 2 KV heads, head_dim 16): a q/k swap keeps
    the total 128 and used to load silently into the wrong rows."""
    cfg = tiny_config(model_type)
    w = random_weights(cfg, seed=7)
    a = "model.layers.1.self_attn"
    w[f"{a}.q_proj.weight"] = torch.randn(32, 64)
    w[f"{a}.k_proj.weight"] = torch.randn(64, 64)
    path = _write(tmp_path, cfg, w)
    with pytest.raises(CheckpointError) as e:
        load_causal_lm(path)
    msg = str(e.value)
    assert f"'{a}.q_proj.weight' in {path / 'model.safetensors'} has shape (32, 64)" in msg
    assert "expected (64, 64)" in msg and "num_attention_heads 4 x head_dim 16" in msg
    if model_type == "qwen2":  # the biases too
        w = random_weights(cfg, seed=7)
        w[f"{a}.k_proj.bias"], w[f"{a}.v_proj.bias"] = torch.randn(16), torch.randn(48)
        with pytest.raises(CheckpointError, match=r"k_proj.bias' .*\(16,\), expected \(32,\)"):
            load_causal_lm(Checkpoint.from_tensors(cfg.to_hf(), w))


def test_gate_and_up_are_checked_each(tmp_path):
    w = _weights()
    m = "model.layers.0.mlp"
    w[f"{m}.gate_proj.weight"], w[f"{m}.up_proj.weight"] = torch.randn(80, 64), torch.randn(112, 64)
    with pytest.raises(CheckpointError) as e:
        load_causal_lm(_write(tmp_path, tensors=w))
    msg = str(e.value)
    assert f"'{m}.gate_proj.weight'" in msg and "(80, 64), expected (96, 64)" in msg
    assert "intermediate_size 96" in msg


def test_d2t_must_be_integer_and_in_range(tmp_path):
    hcfg = eagle_config(tiny_config(), draft_vocab_size=50)
    w = random_eagle3_weights(hcfg)
    w["d2t"] = w["d2t"].float()
    with pytest.raises(CheckpointError, match=r"'d2t' in .*has dtype float32; d2t needs an int"):
        load_eagle3_head(write_checkpoint(tmp_path / "f", hcfg.to_hf(), w))
    w = random_eagle3_weights(hcfg)
    w["d2t"][7] = 10_000
    with pytest.raises(CheckpointError, match=r"'d2t' in .*maps draft id 7 to target id 10007"):
        load_eagle3_head(write_checkpoint(tmp_path / "r", hcfg.to_hf(), w))


def test_eagle3_target_width_is_checked(tmp_path):
    hcfg = eagle_config(tiny_config(), draft_vocab_size=50, target_hidden_size=32)
    path = write_checkpoint(tmp_path, hcfg, random_eagle3_weights(hcfg))
    target = random_causal_lm(tiny_config(), seed=1)
    with pytest.raises(CheckpointError, match=r"states 32 wide .*config.json.*hidden_size is 64"):
        load_eagle3_head(path, target=target)


# ---- 2. malformed files: ValueError naming the file --------------------------------------


@pytest.mark.parametrize("text", ["[1, 2]", "42", "null", '"config"'])
def test_config_json_not_an_object(tmp_path, text):
    path = _write(tmp_path)
    (path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"config.json must hold a JSON object .*got "):
        load_causal_lm(path)


def test_config_json_not_utf8_or_not_json(tmp_path):
    path = _write(tmp_path)
    (path / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(CheckpointError, match=r"config.json is not valid JSON"):
        load_causal_lm(path)
    (path / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(CheckpointError, match=r"config.json is not valid JSON"):
        load_causal_lm(path)


def test_in_memory_config_not_a_dict():
    with pytest.raises(TypeError, match="config must be a config.json dict, got list"):
        Checkpoint.from_tensors([1], {})
    from specdraft.models.config import DecoderConfig

    with pytest.raises(ValueError, match="x/config.json must hold a JSON object .*got list"):
        DecoderConfig.from_hf([1], source="x/config.json")


def _sharded(tmp_path):
    cfg = tiny_config()
    return write_checkpoint(tmp_path, cfg, random_weights(cfg), num_shards=2)


@pytest.mark.parametrize(
    "text, words",
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "has no weight_map"),
        ('{"weight_map": []}', "has no weight_map"),
        ('{"weight_map": {"lm_head.weight": 3}}', "must map tensor names to file names"),
    ],
)
def test_bad_index_names_the_index(tmp_path, text, words):
    path = _sharded(tmp_path)
    (path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match=words) as e:
        load_causal_lm(path)
    assert str(path / "model.safetensors.index.json") in str(e.value)


def _safetensors_bytes(kind: str, good: bytes) -> bytes:
    return {
        "empty": b"",
        "truncated": good[: len(good) - 100],
        "short header": good[:20],
        "garbage": b"this is not a safetensors file at all",
    }[kind]


@pytest.mark.parametrize("kind", ["empty", "truncated", "short header", "garbage"])
def test_corrupt_safetensors_names_the_file(tmp_path, kind):
    path = _write(tmp_path)
    f = path / "model.safetensors"
    f.write_bytes(_safetensors_bytes(kind, f.read_bytes()))
    with pytest.raises(CheckpointError) as e:
        load_causal_lm(path)
    assert f"{f} is not a readable safetensors file" in str(e.value)


def test_corrupt_shard_names_the_shard(tmp_path):
    """With an index, shards open only when read: the error still names the shard."""
    path = _sharded(tmp_path)
    f = path / "model-00002-of-00002.safetensors"
    f.write_bytes(f.read_bytes()[:-50])
    with pytest.raises(CheckpointError, match=rf"{f} is not a readable safetensors file"):
        load_causal_lm(path)


def test_index_lists_tensor_in_wrong_shard(tmp_path):
    path = _sharded(tmp_path)
    index = path / "model.safetensors.index.json"
    d = json.loads(index.read_text())
    wm = d["weight_map"]
    wm["model.norm.weight"] = next(f for f in set(wm.values()) if f != wm["model.norm.weight"])
    index.write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=r"cannot read tensor 'model.norm.weight' from .*"):
        load_causal_lm(path)


def test_same_tensor_in_two_files_without_index(tmp_path):
    path = _write(tmp_path)
    t = load_file(path / "model.safetensors")
    save_file({"model.norm.weight": t["model.norm.weight"]}, path / "extra.safetensors")
    with pytest.raises(
        CheckpointError, match=r"'model.norm.weight' is in both .*extra.safetensors"
    ):
        load_causal_lm(path)


BAD_FIELDS = [
    ({"hidden_size": "64"}, r"hidden_size must be an integer >= 1, got '64' \(str\)"),
    ({"vocab_size": 256.0}, r"vocab_size must be an integer >= 1, got 256.0"),
    ({"num_hidden_layers": -2}, r"num_hidden_layers must be an integer >= 1, got -2"),
    ({"num_hidden_layers": True}, r"num_hidden_layers must be an integer >= 1, got True"),
    ({"intermediate_size": [96]}, r"intermediate_size must be an integer"),
    ({"num_attention_heads": 0, "head_dim": None}, r"num_attention_heads must be an integer"),
    ({"num_key_value_heads": 0}, r"num_key_value_heads must be an integer >= 1, got 0"),
    ({"num_key_value_heads": 3}, r"num_attention_heads 4 must be a multiple of num_key_value_h"),
    ({"head_dim": 15}, r"head_dim must be even and at most 256, got 15"),
    ({"head_dim": 512}, r"head_dim must be even and at most 256, got 512"),
    ({"head_dim": "16"}, r"head_dim must be an integer"),
    (
        {"hidden_size": 66, "head_dim": None},
        r"hidden_size 66 is not a multiple of num_attention_heads 4, and there is no head_dim",
    ),
    ({"tie_word_embeddings": "false"}, r"tie_word_embeddings must be true or false, got 'false'"),
    ({"attention_bias": 1}, r"attention_bias must be true or false"),
    ({"rms_norm_eps": "1e-5"}, r"rms_norm_eps must be a number, got '1e-5'"),
    ({"rms_norm_eps": -1e-5}, r"rms_norm_eps must be a positive number"),
    ({"max_position_embeddings": "4k"}, r"max_position_embeddings must be an integer"),
    ({"partial_rotary_factor": "1"}, r"partial_rotary_factor must be a number"),
    ({"rope_theta": "1e4"}, r"rope_theta must be a number"),
    ({"rope_scaling": "linear"}, r"rope_scaling must be an object or null, got 'linear'"),
    ({"rope_scaling": {"rope_type": "linear"}}, r"lacks rope_scaling.factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "4"}}, r"rope_scaling.factor must be"),
    ({"rope_scaling": {"rope_type": 3}}, r"rope_scaling.rope_type must be a string"),
    ({"rope_parameters": [10000.0]}, r"rope_parameters must be an object"),
    (
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0}},
        r"llama3 rope needs high_freq_factor > low_freq_factor",
    ),
    ({"torch_dtype": "int8"}, r"torch_dtype 'int8' is not a dtype specdraft builds models in"),
    ({"torch_dtype": "float8_e4m3fn"}, r"torch_dtype 'float8_e4m3fn' is not a dtype"),
    ({"torch_dtype": 16}, r"torch_dtype must be a string"),
    ({"architectures": "LlamaForCausalLM"}, r"architectures must be a list of class names"),
    ({"model_type": ["llama"]}, r"model_type must be a string"),
    ({"mlp_bias": "no"}, r"mlp_bias must be true or false"),
]


@pytest.mark.parametrize("changes, words", BAD_FIELDS, ids=[str(c) for c, _ in BAD_FIELDS])
def test_bad_config_fields_name_file_and_field(tmp_path, changes, words):
    path = _write(tmp_path, **changes)  # a None value removes the key
    with pytest.raises(ValueError, match=words) as e:
        load_causal_lm(path)
    assert str(path / "config.json") in str(e.value)


def _edit(path, **changes):
    f = path / "config.json"
    d = json.loads(f.read_text())
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    f.write_text(json.dumps(d))


def test_draft_vocab_larger_than_vocab_names_the_file(tmp_path):
    hcfg = eagle_config(tiny_config(), draft_vocab_size=50)
    path = write_checkpoint(tmp_path, hcfg, random_eagle3_weights(hcfg))
    _edit(path, draft_vocab_size=1000)
    with pytest.raises(ValueError, match=r"config.json: draft_vocab_size must be in \[1, vocab_si"):
        load_eagle3_head(path)


def test_unsupported_rope_type_names_the_file(tmp_path):
    path = _write(tmp_path, rope_scaling={"type": "dynamic", "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match=r"config.json: rope type 'dynamic' is not"):
        load_causal_lm(path)


# ---- 3. arguments ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int8, "int8", torch.float8_e4m3fn, torch.float64, 3])
def test_dtype_argument_must_be_a_float_dtype(tmp_path, dtype):
    path = _write(tmp_path)
    with pytest.raises(TypeError, match=r"^dtype must be bfloat16, float16 or float32, got "):
        load_causal_lm(path, dtype=dtype)


# ids spelled out: an id "gpu" would be read as the gpu marker and skipped on CPU.
@pytest.mark.parametrize(
    "device", ["gpu", "cuda:x", "", "cuda:-1"], ids=["type", "index", "empty", "negative"]
)
def test_invalid_device_string(tmp_path, device):
    path = _write(tmp_path)
    with pytest.raises(ValueError, match=rf"^device '{device}' is not a valid torch device"):
        load_causal_lm(path, device=device)
    hcfg = eagle_config(tiny_config(), draft_vocab_size=50)
    e3 = write_checkpoint(tmp_path / "e3", hcfg, random_eagle3_weights(hcfg))
    with pytest.raises(ValueError, match=rf"^device '{device}' is not a valid torch device"):
        load_eagle3_head(e3, device=device)


def test_device_of_wrong_type(tmp_path):
    with pytest.raises(TypeError, match=r"^device must be a torch.device, a string .*got float"):
        load_causal_lm(_write(tmp_path), device=1.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda(tmp_path):
    with pytest.raises(ValueError, match=r"^device 'cuda:0': CUDA is not available"):
        load_causal_lm(_write(tmp_path), device="cuda:0")


def test_path_is_a_file_names_its_directory(tmp_path):
    path = _write(tmp_path)
    for f in ("config.json", "model.safetensors"):
        with pytest.raises(
            CheckpointError, match=rf"is not a directory: pass the directory .*{path}"
        ):
            load_causal_lm(path / f)


@pytest.mark.parametrize("bad", [None, 3, ["a"]])
def test_path_of_wrong_type(bad):
    with pytest.raises(TypeError, match=r"^path must be a checkpoint directory \(str or os.Path"):
        load_causal_lm(bad)
    with pytest.raises(TypeError, match=r"^path must be a checkpoint directory"):
        load_draft(bad)


def test_empty_path_is_not_the_working_directory():
    with pytest.raises(ValueError, match="^path is empty"):
        load_causal_lm("")


def test_target_of_wrong_type(tmp_path):
    hcfg = eagle_config(tiny_config(), draft_vocab_size=50)
    e3 = write_checkpoint(tmp_path, hcfg, random_eagle3_weights(hcfg))
    with pytest.raises(TypeError, match=r"^target must be a LlamaForCausalLM .*got str"):
        load_eagle3_head(e3, target=str(e3))


@pytest.mark.parametrize("bad, exc", [(0, ValueError), (-4, ValueError), ("64", TypeError)])
def test_max_positions(tmp_path, bad, exc):
    with pytest.raises(exc, match=r"^max_positions must be"):
        load_causal_lm(_write(tmp_path), max_positions=bad)


def test_subclass_storing_tensors_its_own_way_is_checked_after_get():
    """A Checkpoint subclass that dequantizes in `get` (as the GGUF reader does) has no
    stored dtype to check up front: its float tensors load, integer ones are refused."""

    class OwnStorage(Checkpoint):
        def __init__(self, tensors, as_dtype):
            super().__init__(tiny_config().to_hf(), None, where="/x/model.own")
            self.w, self.as_dtype = tensors, as_dtype

        def names(self):
            return set(self.w)

        def shape(self, name):
            return tuple(self.w[name].shape)

        def get(self, name):
            return self.w[name].to(self.as_dtype)

    w = random_weights(tiny_config(), seed=7)
    model = load_causal_lm(OwnStorage(w, torch.float32))
    assert torch.equal(model.norm.weight, w["model.norm.weight"])
    with pytest.raises(CheckpointError, match=r"'int8' \(tensor 'model.embed.* in /x/model.own"):
        load_causal_lm(OwnStorage(w, torch.int8))


def test_head_device_must_match_the_target(tmp_path):
    hcfg = eagle_config(tiny_config(), draft_vocab_size=50)
    path = write_checkpoint(tmp_path, hcfg, random_eagle3_weights(hcfg, with_embed=False))
    target = random_causal_lm(tiny_config(), seed=1)
    with pytest.raises(ValueError, match=r"^device 'meta' differs from the target's device cpu"):
        load_eagle3_head(path, target=target, device="meta")
    assert load_eagle3_head(path, target=target, device="cpu").fc.weight.device.type == "cpu"
