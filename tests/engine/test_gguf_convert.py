"""A GGUF file converted a tensor at a time (engine.gguf_convert): the tensors transformers' whole-model GGUF load
holds, bit for bit, in shards the loader reads. (Gemma 3's conversion, with its own tensor processor, is checked
end to end by tests/engine/test_gguf_packed.py's greedy parity with transformers on the real file.)"""

import functools
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from agentrt.engine import gguf_convert
from agentrt.engine.loader import gguf_source, load_hf_config, load_model, resolve_model
from agentrt.engine.model_args import ModelArgs
from tests.conftest import requires_default_model
from tests.engine.test_dense_architectures import engine_logits


@pytest.fixture(autouse=True)
def name_map_built_once(monkeypatch):
    """transformers' `get_gguf_hf_weights_map` (write_dequantized's and its own GGUF load's) builds gguf's
    `TensorNameMap` anew for each of the ~400 modules it recurses into, ~20 ms each, the same map each time: built
    once per (architecture, layers) here (a read-only lookup table; the same names come out)."""
    import gguf

    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))


def _written(out):
    tensors = {}
    for f in sorted(out.glob("model*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def _transformers_tensors(gguf):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    state = hf.state_dict()
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return hf.config, state


def _assert_same_as_transformers(gguf, out):
    config, want = _transformers_tensors(gguf)
    got = _written(out)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], t), name
    assert ModelArgs.from_hf(load_hf_config(out)) == ModelArgs.from_hf(config)


@requires_default_model
def test_the_default_file_streams_to_transformers_tensors_in_shards(tmp_path):
    gguf = gguf_source(None)
    assert gguf_convert.write_dequantized(gguf, tmp_path, shard_bytes=16 << 20)
    files = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(files) > 3 and not list(tmp_path.glob(".shard-*"))  # 16 MB shards of a 540 MB fp32 model
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in files}
    _assert_same_as_transformers(gguf, tmp_path)
    # the shards load as one checkpoint: the engine computes as on the default model's converted copy
    # (its tokenizer: the files the loader's converted copy holds, which it wrote from the same GGUF file with
    # `AutoTokenizer.from_pretrained(gguf_file=...).save_pretrained`; converting the file's vocabulary again took ~5 s)
    converted = resolve_model(None)
    for f in converted.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, tmp_path / f.name)
    model, _ = load_model(tmp_path, torch.float32, "cpu")
    ref, _ = load_model(converted, torch.float32, "cpu")
    from transformers import AutoModelForCausalLM  # and transformers reads the shards by their index

    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    down = _written(tmp_path)["model.layers.7.mlp.down_proj.weight"]
    assert torch.equal(hf.model.layers[7].mlp.down_proj.weight, down)
    tokens = torch.randint(100, 20000, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    assert torch.equal(engine_logits(model, tokens, 8, 4), engine_logits(ref, tokens, 8, 4))


@requires_default_model
def test_a_processor_that_gathers_tensors_leaves_the_file_to_transformers(tmp_path, monkeypatch):
    """A tensor processor that keeps tensors itself (a mixture's stacked experts) cannot stream: nothing is left
    written and the caller goes through transformers' whole model."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    base = gguf_utils.TENSOR_PROCESSORS["llama"]

    class Gathering(base):
        def process(self, weights, name, **kwargs):
            if name.startswith("blk.3."):
                kwargs["parsed_parameters"]["tensors"][name] = torch.from_numpy(weights.copy())
            return super().process(weights, name, **kwargs)

    monkeypatch.setitem(gguf_utils.TENSOR_PROCESSORS, "llama", Gathering)
    assert not gguf_convert.write_dequantized(gguf_source(None), tmp_path, shard_bytes=1 << 20)
    assert list(tmp_path.iterdir()) == []
