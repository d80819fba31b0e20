"""A GGUF file's tensors written out as fp32 safetensors, one tensor in memory at a time.

The engine loads a GGUF file from a converted copy (engine/loader.py: config, tokenizer, the widened weights that
`quantization="none"` serves and that `GGUFPacker` matches the file's blocks against). transformers' own GGUF
load makes that copy by building the whole fp32 model in memory, every tensor dequantized into one dict first:
a Qwen3-4B-shape Q4_K_M file (16 GB of fp32 weights) peaked at 19.1 GB and took 111 s on a 2-core Xeon; an 8B
file would not fit a 24 GiB machine at all, where llama.cpp serves it in ~5 GB. Streamed: 4.8 GB and 81 s
(SmolLM2: 1.24 -> 0.99 GB, 16.7 -> 12.8 s; the shard of up to 1 GB and the largest tensor's numpy decoding
are most of the peak).

`write_dequantized` takes transformers' pieces one tensor at a time instead: its tensor processor for the
architecture (name fixes, llama.cpp's q/k row permutation undone, Gemma's norm offsets) and its GGUF-to-HF name
map, the `gguf` package's dequantization, and writes shards of ~1 GB as they fill. The tensors are the ones
transformers' `from_pretrained(gguf_file=...)` would hold (tests/engine/test_gguf_convert.py compares them bit
for bit). A processor that gathers tensors across the file (a mixture of experts' stacked experts) is left to
transformers' whole-model load: `write_dequantized` returns False there, having written nothing.
"""

from __future__ import annotations

from pathlib import Path

import torch

SHARD_BYTES = 1 << 30


def write_dequantized(gguf: Path, out: Path, shard_bytes: int = SHARD_BYTES) -> bool:
    """Config and fp32 safetensors of `gguf` into the directory `out` (`model.safetensors`, or shards of about
    `shard_bytes` with transformers' index); False, nothing written, where the architecture's tensor processor
    gathers tensors across the file."""
    import numpy as np
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    from agentrt.engine.gguf_header import gguf_architecture, gguf_tensors

    parsed = load_gguf_checkpoint(str(gguf), return_tensors=False)
    # AutoConfig.from_pretrained(gguf_file=...)'s config, without parsing the file's metadata a second time
    config = CONFIG_MAPPING[parsed["config"]["model_type"]].from_dict(dict(parsed["config"]))
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS.get(gguf_architecture(gguf), TensorProcessor)(config=parsed.get("config", {}))
    names = get_gguf_hf_weights_map(skeleton, processor)
    tied = getattr(config, "tie_word_embeddings", False)
    gathered: dict[str, torch.Tensor] = {}  # where a processor keeps tensors itself (experts): not streamable
    shard: dict[str, torch.Tensor] = {}
    shards: list[tuple[Path, list[str]]] = []  # written so far, under temporary names, and their tensors

    def flush() -> None:
        path = out / f".shard-{len(shards):05d}.safetensors"
        save_file(shard, path, metadata={"format": "pt"})
        shards.append((path, list(shard)))
        shard.clear()

    for name, (type_id, dims, offset) in gguf_tensors(gguf).items():
        result = processor.process(weights=_dequantized(gguf, type_id, dims, offset), name=name,
                                   tensor_key_mapping=names, parsed_parameters={"tensors": gathered})
        if gathered:
            for path, _ in shards:
                path.unlink()
            return False
        if result.name not in names or (tied and names[result.name] == "lm_head.weight"):
            continue
        t = torch.from_numpy(np.copy(result.weights))
        shard[names[result.name]] = t.float() if t.is_floating_point() else t  # from_pretrained(dtype=float32)'s
        if sum(v.numel() * v.element_size() for v in shard.values()) >= shard_bytes:
            flush()
    if shard or not shards:
        flush()
    _name_shards(out, shards)
    config.save_pretrained(out)
    return True


def _name_shards(out: Path, shards: list[tuple[Path, list[str]]]) -> None:
    """The shards under transformers' names: one `model.safetensors`, or `model-0000i-of-0000n.safetensors` and the
    `model.safetensors.index.json` that maps each tensor to its file (so transformers loads the copy too)."""
    import json

    if len(shards) == 1:
        shards[0][0].rename(out / "model.safetensors")
        return
    weight_map, total = {}, 0
    for i, (path, names) in enumerate(shards):
        final = out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += path.stat().st_size
        path.rename(final)
        weight_map.update(dict.fromkeys(names, final.name))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _dequantized(gguf: Path, type_id: int, dims: tuple[int, ...], offset: int):
    """One tensor of the file as the `gguf` package's reader and `dequantize` give it to transformers (numpy, the
    ggml dims reversed), read with a plain file read: the reader maps the whole file (its pages then count in the
    resident memory) and parses every metadata value again (~5 s for a 49k-token vocabulary)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

    qtype = GGMLQuantizationType(type_id)
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    shape = tuple(reversed(dims))
    raw = shape[:-1] + (shape[-1] // block * block_bytes,)
    with open(gguf, "rb") as f:
        f.seek(offset)
        data = np.fromfile(f, dtype=np.uint8, count=int(np.prod(raw))).reshape(raw)
    return dequantize(data, qtype).reshape(shape)
