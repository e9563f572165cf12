"""A tokenizer rebuilt from a GGUF file's metadata, and its chat template.

A GGUF has no tokenizer.json: it stores the vocabulary (tokenizer.ggml.tokens), the BPE
merges, each token's type, the special ids and the Jinja chat template as metadata.
For byte-level BPE vocabularies (tokenizer.ggml.model "gpt2", the GPT-2 / Llama 3 /
Qwen2 / SmolLM family) this module rebuilds the `tokenizers` pipeline transformers
builds from the same keys: a BPE model over the GGUF's tokens and merges, the splitting
regex named by tokenizer.ggml.pre, a byte-level pre-tokenizer and decoder, control
tokens as special added tokens. The template is rendered with jinja2 the way
transformers renders it (sandboxed, trim_blocks, lstrip_blocks, loop controls).

Requires the optional packages `tokenizers` and `jinja2` (pip install 'specdraft[demo]').
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# llama.cpp's token types (tokenizer.ggml.token_type)
CONTROL, USER_DEFINED = 3, 4

# Pre-tokenizer split regexes by tokenizer.ggml.pre (as llama.cpp's llama-vocab.cpp
# splits). None: GPT-2's own regex, which ByteLevel(use_regex=True) applies.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGITS_THEN_GPT2 = "digits"  # "\p{N}" isolated first, then GPT-2's regex
PRE_TOKENIZERS: dict[str, str | None] = {
    "default": None,
    "gpt2": None,
    "gpt-2": None,
    # SmolLM (and StarCoder, Refact, ...): single digits, then the GPT-2 regex; the same
    # as the original tokenizer.json's Digits(individual_digits) + ByteLevel.
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}


def _import(name: str):
    try:
        return __import__(name)
    except ImportError:
        raise ImportError(
            f"the GGUF tokenizer needs the {name} package: pip install 'specdraft[demo]'"
        ) from None


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: printable Latin-1 bytes stand for
    themselves, the other 68 map to U+0100 onwards."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _byte_spelling(token: str, alphabet: set[str]) -> str:
    """A token as the byte-level BPE model spells it. Tokens already written in the
    byte alphabet stay; others (llama.cpp writes some added tokens in plain UTF-8) are
    respelled byte by byte."""
    if set(token) <= alphabet:
        return token
    spell = bytes_to_unicode()
    return "".join(spell[b] for b in token.encode("utf-8"))


def _pre_tokenizer(pre: str | None, where: str):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre not in PRE_TOKENIZERS:
        logger.warning(
            "%s: pre-tokenizer %r is unknown (known: %s); splitting with GPT-2's regex, "
            "which may tokenize some text differently from the original",
            where,
            pre,
            ", ".join(PRE_TOKENIZERS),
        )
        return byte_level
    split = PRE_TOKENIZERS[pre]
    if split is None:
        return byte_level
    if split == _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


class Tokenizer:
    """encode / decode / streaming decode / chat template of a byte-level BPE
    vocabulary described by GGUF metadata. Build it with `from_gguf(path)`."""

    def __init__(self, metadata: Mapping[str, Any], *, where: str = "<metadata>"):
        tokenizers = _import("tokenizers")
        from tokenizers import AddedToken, decoders, models

        self.where = where
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"{where}: tokenizer.ggml.model is {kind!r}; only 'gpt2' (byte-level BPE) "
                f"vocabularies are supported"
            )
        tokens = metadata.get("tokenizer.ggml.tokens")
        merges = metadata.get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise ValueError(f"{where}: metadata lacks tokenizer.ggml.tokens or .merges")
        types = list(metadata.get("tokenizer.ggml.token_type") or [])
        if types and len(types) != len(tokens):
            raise ValueError(
                f"{where}: {len(types)} token types for {len(tokens)} tokens; expected one each"
            )
        alphabet = set(bytes_to_unicode().values())
        vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            vocab.setdefault(_byte_spelling(tok, alphabet), i)
        pairs = []
        for m in merges:
            a, sep, b = m.partition(" ")
            if not sep:
                raise ValueError(f"{where}: merge {m!r} is not two tokens separated by a space")
            pairs.append((a, b))
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
        tok = tokenizers.Tokenizer(bpe)
        self.pre_tokenizer_type = metadata.get("tokenizer.ggml.pre")
        tok.pre_tokenizer = _pre_tokenizer(self.pre_tokenizer_type, where)
        tok.decoder = decoders.ByteLevel()
        # Control tokens stay whole and are special (skipped by decode when asked);
        # user-defined ones stay whole too. Control tokens outside the byte alphabet are
        # llama.cpp mislabels and are left to the BPE model (as transformers does).
        special = [
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, types)
            if ty == CONTROL and set(t) <= alphabet
        ]
        user = [
            AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types)
            if ty == USER_DEFINED
        ]
        tok.add_special_tokens(special)
        tok.add_tokens(user)
        self._tok = tok
        self.special_ids = frozenset(tok.token_to_id(t.content) for t in special)
        self.vocab_size = len(tokens)

        def token_id(key: str) -> int | None:
            value = metadata.get(f"tokenizer.ggml.{key}")
            if value is None:
                return None
            if not 0 <= int(value) < len(tokens):
                raise ValueError(
                    f"{where}: tokenizer.ggml.{key} {value} is outside the vocabulary "
                    f"[0, {len(tokens)})"
                )
            return int(value)

        self.bos_token_id = token_id("bos_token_id")
        self.eos_token_id = token_id("eos_token_id")
        self.pad_token_id = token_id("padding_token_id")
        self.unk_token_id = token_id("unknown_token_id")
        self.eot_token_id = token_id("eot_token_id")
        self.add_bos_token = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        self.add_eos_token = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        self.chat_template: str | None = metadata.get("tokenizer.chat_template")
        self._tokens = tokens

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        from .gguf import read_gguf_metadata

        return cls(read_gguf_metadata(path), where=str(path))

    # ---- tokens -----------------------------------------------------------------------

    def token(self, token_id: int) -> str | None:
        """The token's spelling in the vocabulary (byte-level characters)."""
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _name(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._tokens[token_id]

    @property
    def bos_token(self) -> str | None:
        return self._name(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._name(self.eos_token_id)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end a generation: eos, and end-of-turn when the file names one."""
        ids = (self.eos_token_id, self.eot_token_id)
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>)
        become their ids. add_special_tokens adds bos / eos where the file asks for it
        (tokenizer.ggml.add_bos_token / add_eos_token; SmolLM2 asks for neither)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            if self.add_eos_token and self.eos_token_id is not None:
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, *, skip_special_tokens: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    # ---- chat template ----------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tokenize: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """The prompt the file's chat template renders for `messages` (dicts with
        "role" and "content"), ending with the assistant header when
        add_generation_prompt; tokenize=True returns its ids instead (the template
        writes any bos itself, so none is added). Extra keyword arguments are template
        variables (e.g. tools=...)."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError(f"{self.where}: the file has no tokenizer.chat_template")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TypeError(
                f"messages must be a list of dicts with 'role' and 'content', got "
                f"{type(messages).__name__}"
            )
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m:
                raise TypeError(f"messages[{i}] must be a dict with a 'role', got {m!r}")
        text = _compile(template).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self._name(self.pad_token_id) or "",
            unk_token=self._name(self.unk_token_id) or "",
            **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


class StreamDecoder:
    """Incremental detokenization: push the ids of a growing sequence as they arrive
    and get back only the text they complete. A character split across byte-level
    tokens is held back until its last byte arrives (decoding a partial UTF-8 sequence
    gives U+FFFD), so the pieces concatenate to decode(all ids).

    Keeps two offsets into the ids (as vLLM's detokenizer does): text up to read_offset
    has been emitted; prefix_offset starts a short window decoded for context."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, ids: int | Iterable[int]) -> str:
        """Append new id(s); returns the newly completed text ("" while a character
        is incomplete)."""
        self.ids.extend([ids] if isinstance(ids, int) else ids)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            new = after[len(before) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += new
            return new
        return ""

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes as U+FFFD)."""
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        new = after[len(before) :]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += new
        return new


def _raise(message: str):
    raise ValueError(f"chat template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    jinja2 = _import("jinja2")
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template does not compile: {e}") from None
