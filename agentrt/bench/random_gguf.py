"""A GGUF file of seeded random weights in a real model's shape, quantized by llama.cpp's own quantizer (issue 50).

Issue 50 measures packed GGUF weights on a Q4_K_M file of Qwen3-4B's shape, and nothing here may download one.
`random_gguf` makes it, without a network:
1. Shape: transformers' own config class (`Qwen3Config`) with a preset's numbers (engine.testing.PRESETS,
   "qwen3-4b"); the tensors are those `Qwen3ForCausalLM` builds for it (on the meta device: no memory), named as
   llama.cpp names them (gguf-py's tensor map for its "qwen3" architecture). As convert_hf_to_gguf.py writes a
   Qwen3: q and k rows in HF's order (only a Llama's are permuted), norms in F32, no output tensor when tied.
2. Weights: normal(0, 0.02), norm weights 1, each tensor from a generator seeded by (seed, its name), so a cut
   (`layers`) keeps the full model's first layers. Written F16 a tensor at a time (the header first, then each
   tensor's data): memory holds one tensor (Qwen3-4B's embedding, 0.8 GB), not the 8 GB model.
3. Tokenizer: the default model's (SmolLM2's byte-level BPE, 49152 tokens, copied from its GGUF), its token list
   padded with unused "[PAD<id>]" tokens to the shape's vocabulary, as llama.cpp's converter pads Qwen's own 151669
   tokens to 151936: the embedding is [151936, 2560] as in Qwen3-4B, so the file's bytes and every matmul's shape
   are the real model's; only text never reaches the padded ids. A smaller vocabulary (tests) keeps the first
   tokens and the merges among them.
4. Quantization: llama.cpp's `llama_model_quantize` run by another interpreter (`--llama-python`, where
   llama-cpp-python is installed; never a dependency of agentrt) in a child process; the F16 intermediate is then
   deleted. Q4_K_M is llama.cpp's mix: Q4_K, with Q6_K for the embedding (the tied head) and for about half of
   the attn_v / ffn_down tensors.

The file's name and its metadata key `agentrt.random_weights` state shape, layers, vocabulary, seed and type; an
existing file stating the same is reused. `python -m agentrt.bench.random_gguf` then checks that both peers load
it: llama.cpp (its plain CPU buffers: `use_extra_bufts=False`, since the AMX buffer type of llama-cpp-python 0.3.36
crashed on this project's 2-core AMX VM, agentrt.bench.quant) and agentrt (`quantization="gguf"`), each decoding a
few greedy tokens of one prompt.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from agentrt.engine.loader import cache_dir, default_gguf_path
from agentrt.engine.testing import PRESETS

# llama.cpp's "qwen3" presets. Their head_dim is 128, Qwen3Config's default, which agentrt's conversion relies on:
# transformers' GGUF reader (5.25) does not map qwen3.attention.key_length
SHAPES = tuple(name for name, fields in PRESETS.items() if fields["model_type"] == "qwen3")
FTYPES = ("Q4_K_M", "F16")  # F16: the intermediate itself, no quantizer needed
STD = 0.02
_VERSION = 1  # bump when the weights or the metadata written change: older files are then not reused
_TAG_KEY = "agentrt.random_weights"


def qwen3_config(shape: str, layers: int | None = None, vocab_size: int | None = None):
    """transformers' `Qwen3Config` of preset `shape`, cut to its first `layers` and to `vocab_size` tokens."""
    from transformers import AutoConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {', '.join(SHAPES)}")
    fields = dict(PRESETS[shape])
    if layers is not None:
        if not 1 <= layers <= fields["num_hidden_layers"]:
            raise ValueError(f"layers {layers} is not between 1 and {shape}'s {fields['num_hidden_layers']}")
        fields["num_hidden_layers"] = layers
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def file_name(shape: str, cfg, seed: int, ftype: str) -> str:
    """e.g. "random-qwen3-4b-36L-seed0.Q4_K_M.gguf"; a vocabulary other than the shape's is named too."""
    vocab = "" if cfg.vocab_size == PRESETS[shape]["vocab_size"] else f"-v{cfg.vocab_size}"
    return f"random-{shape}-{cfg.num_hidden_layers}L{vocab}-seed{seed}.{ftype}.gguf"


def _tag(shape: str, cfg, seed: int, ftype: str) -> str:
    return (f"v{_VERSION} {shape} layers={cfg.num_hidden_layers} vocab={cfg.vocab_size} seed={seed} std={STD} "
            f"{ftype}")


def random_gguf(shape: str = "qwen3-4b", out: str | os.PathLike | None = None, *, layers: int | None = None,
                vocab_size: int | None = None, seed: int = 0, ftype: str = "Q4_K_M", llama_python: str | None = None,
                threads: int = 2, log=print) -> Path:
    """The GGUF file of random `shape` weights (`out`: a .gguf path, or a directory for `file_name`'s; default
    `$AGENTRT_CACHE_DIR/gguf/`), made unless one stating the same shape, seed and type is there. `ftype` "Q4_K_M"
    needs `llama_python`, an interpreter that imports llama_cpp."""
    if ftype not in FTYPES:
        raise ValueError(f"ftype must be one of {', '.join(FTYPES)}, got {ftype!r}")
    cfg = qwen3_config(shape, layers, vocab_size)
    out = Path(out).expanduser() if out is not None else cache_dir() / "gguf"
    path = out if out.suffix == ".gguf" else out / file_name(shape, cfg, seed, ftype)
    tag = _tag(shape, cfg, seed, ftype)
    if path.is_file() and _stated_tag(path) == tag:
        log(f"random_gguf: reusing {path} ({tag})")
        return path
    if ftype != "F16":
        from agentrt.bench.quant import llama_cpp_missing

        if (missing := llama_cpp_missing(llama_python)) is not None:
            raise ValueError(f"random_gguf: {ftype} is made by llama.cpp's quantizer: {missing}")
    path.parent.mkdir(parents=True, exist_ok=True)
    f16 = path.with_name(f".{path.stem}.{os.getpid()}.intermediate.gguf")
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        log(f"random_gguf: writing {shape} ({cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}) in F16 to {f16}")
        write_f16_gguf(cfg, f16, seed, tag)
        if ftype == "F16":
            f16.replace(path)
        else:
            log(f"random_gguf: quantizing to {ftype} with llama.cpp ({threads} threads)")
            quantize_with_llama_cpp(llama_python, f16, part, ftype, threads)
            part.replace(path)
    finally:
        f16.unlink(missing_ok=True)
        part.unlink(missing_ok=True)
    return path


def _stated_tag(path: Path) -> str | None:
    from agentrt.engine.gguf_header import gguf_strings

    try:
        return gguf_strings(path, (_TAG_KEY,)).get(_TAG_KEY)
    except (ValueError, OSError):  # not a GGUF file, or a truncated one
        return None


def tensor_plan(cfg) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, shape as torch orders it) of every tensor of `cfg`'s model, in `Qwen3ForCausalLM`'s order (a tied
    LM head is the embedding, listed once)."""
    import gguf
    import torch
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, cfg.num_hidden_layers)
    plan = []
    for hf_name, p in model.named_parameters():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"gguf-py's qwen3 tensor map has no name for {hf_name}")
        plan.append((name, tuple(p.shape)))
    return plan


def write_f16_gguf(cfg, path: Path, seed: int, tag: str = "", tokenizer_from: Path | None = None) -> None:
    """`cfg`'s model with random weights (module docstring, 2.) as an F16 GGUF file with llama.cpp's "qwen3"
    metadata and the donor GGUF's tokenizer (3.; default: the default model's file), one tensor in memory at a time."""
    import gguf
    import numpy as np
    import torch

    plan = tensor_plan(cfg)
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN3])
    w.add_type("model")
    w.add_name(f"random {cfg.model_type} weights ({tag})")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_string(_TAG_KEY, tag)
    for key, value, vtype, sub_type in donor_tokenizer(tokenizer_from or default_gguf_path(), cfg.vocab_size):
        w.add_key_value(key, value, vtype, sub_type)
    for name, shape in plan:  # norms F32 as llama.cpp's converter keeps every 1-D tensor
        dtype = np.dtype(np.float32 if len(shape) == 1 else np.float16)
        w.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape in plan:
        if len(shape) == 1:
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
            continue
        g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8],
                                                         "little"))
        w.write_tensor_data(torch.empty(shape, dtype=torch.float16).normal_(0.0, STD, generator=g).numpy())
    w.close()


def donor_tokenizer(donor: Path, vocab_size: int) -> list[tuple]:
    """The `tokenizer.*` metadata of GGUF file `donor` as (key, value, value type, array item type), its token list
    fitted to `vocab_size`: padded with unused "[PAD<id>]" tokens, or cut to its first tokens with the merges among
    them (a byte-level BPE whose merge `a b` needs `a`, `b` and `ab` all in the vocabulary)."""
    import gguf

    fields = {key: f for key, f in gguf.GGUFReader(donor).fields.items() if key.startswith("tokenizer.")}
    if fields.get("tokenizer.ggml.model") is None or fields["tokenizer.ggml.model"].contents() != "gpt2":
        raise ValueError(f"{str(donor)!r}: the donor tokenizer must be a byte-level BPE (tokenizer.ggml.model gpt2)")
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    merges = fields["tokenizer.ggml.merges"].contents()
    if vocab_size >= len(tokens):
        pads = [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
        if clash := set(pads) & set(tokens):
            raise ValueError(f"{str(donor)!r} already has a token {sorted(clash)[0]!r}")
        tokens, types = tokens + pads, types + [int(gguf.TokenType.UNUSED)] * len(pads)
    else:
        alphabet = max(i for i, t in enumerate(tokens) if len(t) == 1) + 1  # text must still encode
        need = max([alphabet] + [int(f.contents()) + 1 for key, f in fields.items() if key.endswith("_token_id")])
        if vocab_size < need:
            raise ValueError(f"vocab_size {vocab_size} would cut {str(donor)!r}'s byte alphabet or special tokens "
                             f"(it needs at least {need})")
        tokens, types = tokens[:vocab_size], types[:vocab_size]
        kept = set(tokens)
        merges = [m for m in merges if (parts := m.split(" ")) and all(p in kept for p in parts)
                  and "".join(parts) in kept]
    values = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges}
    out = []
    for key, f in fields.items():
        array = f.types[0] == gguf.GGUFValueType.ARRAY
        out.append((key, values.get(key, f.contents()), f.types[0], f.types[-1] if array else None))
    return out


# Run by the peer's interpreter (no agentrt, no torch there): argv[1] is a JSON object of the settings.
_QUANTIZE_CHILD = r"""
import ctypes, json, sys
import llama_cpp
a = json.loads(sys.argv[1])
p = llama_cpp.llama_model_quantize_default_params()
p.nthread, p.ftype = a["threads"], getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + a["ftype"])
sys.exit(1 if llama_cpp.llama_model_quantize(a["src"].encode(), a["dst"].encode(), ctypes.byref(p)) else 0)
"""


def quantize_with_llama_cpp(python: str, src: Path, dst: Path, ftype: str = "Q4_K_M", threads: int = 2) -> None:
    """llama.cpp's `llama_model_quantize` of `src` into `dst`, run by `python` (llama-cpp-python's interpreter)."""
    args = {"src": str(src), "dst": str(dst), "ftype": ftype, "threads": threads}
    out = subprocess.run([python, "-c", _QUANTIZE_CHILD, json.dumps(args)], capture_output=True, text=True)
    if out.returncode != 0:
        tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-5:])
        raise RuntimeError(f"random_gguf: llama.cpp's quantizer failed (exit {out.returncode}):\n{tail}")


def tensor_types(path: Path) -> Counter:
    """ggml type name -> how many of the file's tensors have it."""
    import gguf

    from agentrt.engine.gguf_header import gguf_tensors

    return Counter(gguf.GGMLQuantizationType(t).name for t, _, _ in gguf_tensors(path).values())


PROMPT = "The capital of France is"

# The llama.cpp load check, run by the peer's interpreter: argv[1] is a JSON object; prints one JSON line.
_LLAMA_CHECK_CHILD = r"""
import ctypes, json, sys
import numpy as np
import llama_cpp
a = json.loads(sys.argv[1])
_quiet = llama_cpp.llama_log_callback(lambda level, text, data: None)
llama_cpp.llama_log_set(_quiet, ctypes.c_void_p())
llama_cpp.llama_backend_init()
mp = llama_cpp.llama_model_default_params()
mp.use_extra_bufts = False
model = llama_cpp.llama_model_load_from_file(a["path"].encode(), mp)
if not model:
    sys.exit("llama.cpp could not load the model")
vocab = llama_cpp.llama_model_get_vocab(model)
n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
cp = llama_cpp.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch = 256, 256, 256
cp.n_threads = cp.n_threads_batch = a["threads"]
ctx = llama_cpp.llama_init_from_model(model, cp)
text = a["prompt"].encode()
ids = (llama_cpp.llama_token * 256)()
n = llama_cpp.llama_tokenize(vocab, text, len(text), ids, 256, False, False)
prompt, greedy = list(ids[:n]), []
batch = llama_cpp.llama_batch_get_one(ids, n)
for _ in range(a["max_tokens"]):
    if llama_cpp.llama_decode(ctx, batch) != 0:
        sys.exit("llama_decode failed")
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
    tok = (llama_cpp.llama_token * 1)(int(np.argmax(logits)))
    greedy.append(tok[0])
    batch = llama_cpp.llama_batch_get_one(tok, 1)
desc = ctypes.create_string_buffer(256)
llama_cpp.llama_model_desc(model, desc, 256)
print(json.dumps({"desc": desc.value.decode(), "n_params": llama_cpp.llama_model_n_params(model),
                  "size_bytes": llama_cpp.llama_model_size(model), "n_layer": llama_cpp.llama_model_n_layer(model),
                  "n_embd": llama_cpp.llama_model_n_embd(model), "n_vocab": n_vocab, "prompt_ids": prompt,
                  "greedy": greedy, "version": llama_cpp.__version__}))
"""


def check_llama_cpp(python: str, path: Path, max_tokens: int = 4, threads: int = 2) -> dict:
    """llama.cpp loads `path` and decodes `max_tokens` greedy tokens of `PROMPT` (run by `python`)."""
    args = {"path": str(path), "prompt": PROMPT, "max_tokens": max_tokens, "threads": threads}
    out = subprocess.run([python, "-c", _LLAMA_CHECK_CHILD, json.dumps(args)], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if out.returncode != 0:
        raise RuntimeError(f"random_gguf: llama.cpp's load check failed (exit {out.returncode}): "
                           f"{(out.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_agentrt(path: Path, max_tokens: int = 4) -> dict:
    """agentrt loads `path` with its weights kept packed (`quantization="gguf"`) and decodes `max_tokens` greedy
    tokens of `PROMPT`; its start-up line says what was kept packed."""
    from agentrt.engine import LLM, SamplingParams

    llm = LLM(str(path), quantization="gguf", kv_cache_bytes=64 << 20, device="cpu")
    try:
        prompt = llm.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
        out = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                           progress=False)
        a = llm.core.model.args
        return {"startup_line": llm.core.startup_line, "prompt_ids": prompt, "greedy": list(out[0].token_ids),
                "n_layer": a.num_layers, "n_embd": a.hidden_size, "n_vocab": a.vocab_size}
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agentrt.bench.random_gguf", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-4b", choices=SHAPES)
    ap.add_argument("--out", default=None, help="a .gguf path, or a directory for the file's own name "
                                                "(default: $AGENTRT_CACHE_DIR/gguf, ~/.cache/agentrt/gguf)")
    ap.add_argument("--llama-python", default=None,
                    help="a python where llama-cpp-python is installed (e.g. /work/llamacpp/bin/python): its "
                         "quantizer makes the file and its loader checks it")
    ap.add_argument("--ftype", default="Q4_K_M", choices=FTYPES)
    ap.add_argument("--layers", type=int, default=None, help="the shape's first N layers (default: all)")
    ap.add_argument("--vocab-size", type=int, default=None, help="default: the shape's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's quantizer and load check threads")
    ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                    help="load the file with llama.cpp (with --llama-python) and agentrt, a few greedy tokens each")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    a = ap.parse_args(argv)
    if a.threads < 1:
        ap.error(f"--threads must be >= 1, got {a.threads}")
    try:
        path = random_gguf(a.shape, a.out, layers=a.layers, vocab_size=a.vocab_size, seed=a.seed, ftype=a.ftype,
                           llama_python=a.llama_python, threads=a.threads,
                           log=lambda line: print(line, file=sys.stderr, flush=True))
    except ValueError as e:
        ap.error(str(e))
    result = {"path": str(path), "size_bytes": path.stat().st_size, "tensor_types": dict(tensor_types(path))}
    if a.check:
        if a.llama_python:
            result["llama.cpp"] = check_llama_cpp(a.llama_python, path, threads=a.threads)
        result["agentrt"] = check_agentrt(path)
    if a.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['path']}: {result['size_bytes']:,} bytes; tensors "
          + ", ".join(f"{n} {t}" for t, n in Counter(result["tensor_types"]).most_common()))
    for peer in ("llama.cpp", "agentrt"):
        if peer in result:
            print(f"{peer}: {json.dumps(result[peer])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
