"""quantization="gguf": the default model's Q4_1 projections kept in the file's blocks (engine.gguf_weights)."""

from collections import Counter

import pytest
import torch

from agentrt.engine import LLM, EngineConfig, SamplingParams
from agentrt.engine.loader import gguf_source, load_model, resolve_model
from agentrt.kernels.quant import quant_embedding
from tests.conftest import requires_default_model
from tests.engine.test_dense_architectures import engine_logits
from tests.kernels.test_kernels_linear import _vm_flags


def _nmse(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((ours.double() - ref.double()) ** 2).sum() / (ref.double() ** 2).sum())


@pytest.fixture(scope="module")
def gguf_reader():
    """The `gguf` package's reader of the default file (it parses every metadata value: ~3 s), once for the module."""
    import gguf as gguf_pkg

    return gguf_pkg.GGUFReader(str(gguf_source(None)))


@pytest.fixture(scope="module")
def models():
    path, gguf = resolve_model(None), gguf_source(None)
    packed, _ = load_model(path, torch.float32, "cpu", packed_from=gguf)
    widened, _ = load_model(path, torch.float32, "cpu")
    return packed, widened, gguf


@requires_default_model
def test_projections_hold_the_files_blocks(models, gguf_reader):
    packed, widened, path = models
    layers = packed.args.num_layers
    # q, k, v, o, gate, up, down per layer, and the tied LM head on the token embedding's Q8_0 blocks
    assert packed.packed_weights.formats == Counter({"Q4_1": 7 * layers, "Q8_0": 1})
    qkv = packed.layers[0].self_attn.qkv_proj
    assert qkv.weight.numel() == 0 and [p.format_name for p in qkv.quant] == ["Q4_1"]  # widened copy dropped
    assert widened.packed_weights is None and widened.layers[0].self_attn.qkv_proj.quant is None
    quantized = [t for t in gguf_reader.tensors if t.tensor_type.name in ("Q4_1", "Q8_0")]
    assert packed.packed_weights.nbytes == sum(int(t.n_bytes) for t in quantized)  # the file's bytes, no more
    assert packed.packed_weights.describe().startswith("gguf Q4_1+Q8_0 kept packed, 96 MB")
    # the token embedding is looked up from its Q8_0 blocks: no widened copy
    assert packed.embed_tokens.weight.numel() == 0 and packed.embed_quant.format_name == "Q8_0"
    # every block a decode step streams lies in a mapping advised for 2 MB pages (the tied head's included)
    streamed = [p for m in packed.modules() if getattr(m, "quant", None) for p in m.quant] + [*packed.tied_head_quant]
    flags = [_vm_flags(p.data.data_ptr()) for p in streamed]
    assert all(f is None or "hg" in f for f in flags), flags
    ids = torch.tensor([0, 7, 49151, 7])
    assert torch.equal(quant_embedding(ids, packed.embed_quant), widened.embed_tokens(ids))


@requires_default_model
def test_each_layer_is_packed_before_the_next_one_loads(monkeypatch):
    """The file's blocks go in as the model loads: when layer i's weights are in, every earlier layer already holds
    blocks and no widened projection (a 4B Q4_K_M file peaked at 8.8 GB with the whole widened model loaded first,
    3.6 GB this way)."""
    from agentrt.engine import gguf_weights, loader
    from agentrt.kernels.linear import Linear

    read, seen = [], []  # checkpoint tensors in the order read; per packer call: (layer, tensors read by then, ...)
    getitem, loaded = loader._LazyStateDict.__getitem__, gguf_weights.GGUFPacker.loaded

    def reading(self, name):
        read.append(name)
        return getitem(self, name)

    def packing(self, i):
        earlier = [m for layer in self.model.layers[: max(i, 0)] for m in layer.modules() if isinstance(m, Linear)]
        seen.append((i, len(read), sum(m.weight.numel() > 0 or m.quant is None for m in earlier)))
        loaded(self, i)

    monkeypatch.setattr(loader._LazyStateDict, "__getitem__", reading)
    monkeypatch.setattr(gguf_weights.GGUFPacker, "loaded", packing)
    model, _ = load_model(resolve_model(None), torch.float32, "cpu", packed_from=gguf_source(None))
    layers = model.args.num_layers
    assert [i for i, _, _ in seen] == [-1, *range(layers)]
    for i, n_read, widened in seen:
        assert widened == 0  # every earlier layer holds blocks only
        later = [name for name in read[:n_read] if name.startswith("model.layers.")
                 and int(name.split(".")[2]) > i]
        assert later == []  # and no later layer's tensor was read yet
    assert model.packed_weights.formats == Counter({"Q4_1": 7 * layers, "Q8_0": 1})


@requires_default_model
def test_rows_that_match_no_order_midway_leave_the_model_widened(monkeypatch, models):
    """A layer whose blocks decode to none of the known row orders, found after earlier layers were packed: the
    model is loaded again widened, with the reason, and computes as the widened one."""
    from agentrt.engine import gguf_weights

    matching = gguf_weights._matching_rows

    def fails_in_layer_5(data, type_id, shape, want, name, *rest):
        if name.startswith("blk.5."):
            raise gguf_weights._Unpackable(f"the rows of {name} do not decode to the converted weights")
        return matching(data, type_id, shape, want, name, *rest)

    monkeypatch.setattr(gguf_weights, "_matching_rows", fails_in_layer_5)
    model, _ = load_model(resolve_model(None), torch.float32, "cpu", packed_from=gguf_source(None))
    assert model.packed_weights is None and model.widen_reason.startswith("the rows of blk.5.attn_q.weight")
    assert all(layer.self_attn.qkv_proj.quant is None for layer in model.layers)
    widened = models[1]
    tokens = torch.randint(100, 20000, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    assert torch.equal(engine_logits(model, tokens, 8, 4), engine_logits(widened, tokens, 8, 4))


@requires_default_model
def test_logits_match_the_widened_engine(models):
    packed, widened, _ = models
    tokens = torch.randint(100, 20000, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    # a prompt of 24 in chunks of 7 (many-row calls), then 16 one-row decode steps
    ours, ref = engine_logits(packed, tokens, 24, 7), engine_logits(widened, tokens, 24, 7)
    assert _nmse(ours, ref) <= 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@requires_default_model
@pytest.mark.slow
def test_greedy_matches_hf(models):
    from transformers import AutoModelForCausalLM

    llm = LLM(str(gguf_source(None)), quantization="gguf", num_blocks=64)
    assert "weights: gguf Q4_1+Q8_0 kept packed" in llm.core.startup_line
    ids = llm.tokenizer("The history of computing is a story of abstraction. Early machines were programmed by "
                        "rewiring circuits; later, stored programs let instructions live in memory.")["input_ids"]
    prompts = [ids[:n] for n in (5, 12, 31)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model(None)), dtype=torch.float32)
    eos = llm.tokenizer.eos_token_id
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=16,
                          do_sample=False)[0, len(p):].tolist()
        assert o.token_ids == (ref[: ref.index(eos) + 1] if eos in ref else ref)


@pytest.fixture(scope="module")
def bf16_models():
    from agentrt.kernels import cpu

    if cpu.compiled_isa() != "avx512_bf16":
        pytest.skip("the bf16 block kernels and the fused packed decode need an AVX512-BF16 build")
    path, gguf = resolve_model(None), gguf_source(None)
    packed, _ = load_model(path, torch.bfloat16, "cpu", packed_from=gguf)
    widened, _ = load_model(path, torch.bfloat16, "cpu")
    return packed, widened


@requires_default_model
def test_bf16_logits_match_the_widened_engine_and_the_fused_step_the_module_path(bf16_models, monkeypatch):
    packed, widened = bf16_models
    tokens = torch.randint(100, 20000, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    assert packed._decode_fusable(1, 1, torch.empty(1, dtype=torch.bfloat16))  # decode steps run decode_forward
    fused = engine_logits(packed, tokens, 20, 7)
    assert _nmse(fused, engine_logits(widened, tokens, 20, 7)) <= 1e-3  # bf16 rounding at other places
    monkeypatch.setattr(type(packed), "_decode_fusable", lambda *a: False)
    assert torch.equal(fused, engine_logits(packed, tokens, 20, 7))  # decode_forward on block parts: the same bits


@requires_default_model
@pytest.mark.parametrize("rows", [2, 9])
def test_bf16_multi_step_decode_matches_step_by_step(bf16_models, monkeypatch, rows):
    # decode_steps (one C++ call: packed embedding lookup, layers, the tied Q8_0 head, argmax) against the
    # runner's step-by-step path on the same model; 9 rows: the block kernels' widened panels (not batch-invariant)
    # in both
    packed, _ = bf16_models
    a = packed.args
    if rows == 2:
        kv = torch.zeros(a.num_layers, 2, 9, 4, a.num_kv_heads, a.head_dim, dtype=torch.bfloat16)
        table = torch.arange(1, 9, dtype=torch.int32).view(1, -1)
        ids, pos, stops = torch.tensor([5, 900]), torch.tensor([0, 3]), torch.full((2, 1), -1)
        tables = torch.cat([table, table.flip(1)])
    else:  # 3 blocks of 4 positions a row (positions 0-8 at most), rows on their own blocks
        kv = torch.zeros(a.num_layers, 2, 1 + 3 * rows, 4, a.num_kv_heads, a.head_dim, dtype=torch.bfloat16)
        tables = torch.arange(1, 1 + 3 * rows, dtype=torch.int32).view(rows, 3)
        ids = torch.randint(100, 20000, (rows,), generator=torch.Generator().manual_seed(2))
        pos, stops = torch.arange(rows) % 4, torch.full((rows, 1), -1)
    from agentrt.kernels import cpu

    ops, calls = cpu.ops(), []

    class Spy:  # the C++ ops, counting decode_steps calls
        def __getattr__(self, name):
            if name == "decode_steps":
                calls.append(name)
            return getattr(ops, name)

    with monkeypatch.context() as m:
        m.setattr(cpu, "ops", lambda *a: Spy())
        fused = packed.decode_steps(ids, pos, kv.clone(), tables, stops, 6)
    assert calls == ["decode_steps"]
    monkeypatch.setattr(type(packed), "_decode_fusable", lambda *a: False)
    looped = packed.decode_steps(ids, pos, kv.clone(), tables, stops, 6)
    assert torch.equal(fused[0], looped[0]) and torch.equal(fused[1], looped[1])


@requires_default_model
def test_bf16_deterministic_mode_keeps_a_row_independent_of_the_batch(bf16_models):
    # the engine's deterministic mode reaches the block kernels: 9 rows (past WIDEN_MIN_ROWS) give each row the bits it
    # gets alone, through a projection and the tied Q8_0 head
    from agentrt.kernels.linear import Linear

    packed, _ = bf16_models
    lin = next(m for m in packed.modules() if isinstance(m, Linear) and m.quant is not None)
    x = torch.randn(9, lin.in_features, generator=torch.Generator().manual_seed(3)).bfloat16()
    h = torch.randn(9, packed.args.hidden_size, generator=torch.Generator().manual_seed(4)).bfloat16()
    packed.set_batch_invariant(True)
    try:
        assert torch.equal(lin(x)[4:5], lin(x[4:5]))
        assert torch.equal(packed.compute_logits(h)[4:5], packed.compute_logits(h[4:5]))
    finally:
        packed.set_batch_invariant(False)


def test_deterministic_mode_is_off_by_default_for_packed_projections():
    # packed projections' batch-invariant path is the blocks' integer one at every row count (~1/3 of the widened
    # panels' throughput at 32 calls), so the mode is on by default only where it is cheap; asked for, it holds
    for q in ("gguf", "int8", "int4"):
        c = EngineConfig(quantization=q, device="cpu", dtype="bfloat16")
        assert c.deterministic is False and c.deterministic_default, q
        assert EngineConfig(quantization=q, device="cpu", dtype="bfloat16", deterministic=True).deterministic, q
    for q in (None, "none"):
        assert EngineConfig(quantization=q, device="cpu", dtype="bfloat16").deterministic, q


def test_quantization_refusals(monkeypatch):
    with pytest.raises(ValueError, match="got 'q4'"):
        EngineConfig(quantization="q4", device="cpu")
    with pytest.raises(ValueError, match="does not serve LoRA adapters yet"):
        EngineConfig(quantization="gguf", device="cpu", enable_lora=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="'gguf' runs on CPU only"):
        EngineConfig(quantization="gguf", device="cuda", dtype="bfloat16")


def test_gguf_quantization_of_a_safetensors_model_is_refused(tiny_model_path):
    with pytest.raises(ValueError, match="cannot keep .* packed: the model is not a GGUF file"):
        LLM(str(tiny_model_path), quantization="gguf", device="cpu", num_blocks=16)


def test_cli_flag_reaches_the_engine_config():
    import argparse

    from agentrt._cli_options import add_engine_options, engine_options

    p = argparse.ArgumentParser()
    add_engine_options(p)
    assert engine_options(p.parse_args(["--quantization", "gguf"]))["quantization"] == "gguf"
    assert "quantization" not in engine_options(p.parse_args([]))


@requires_default_model
def test_header_reader_agrees_with_the_gguf_package(gguf_reader):
    from agentrt.engine.gguf_header import gguf_tensors

    path = gguf_source(None)
    ours = gguf_tensors(path)
    theirs = gguf_reader.tensors
    assert len(ours) == len(theirs) == 272
    for t in theirs:
        assert ours[t.name] == (int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.data_offset)), t.name


@pytest.fixture(scope="module")
def gemma3_gguf():
    from agentrt.engine.loader import ModelNotFoundError, gemma3_270m_path

    try:
        return gemma3_270m_path()
    except ModelNotFoundError as e:
        pytest.skip(f"Gemma 3 270M is not installed (scripts/setup.sh installs it): {e}")


@pytest.mark.slow  # two 270M models with a 262k vocabulary in fp32
def test_gemma3_q4_k_m_logits_match_the_widened_engine(gemma3_gguf):
    path = resolve_model(gemma3_gguf)
    tokens = torch.randint(100, 20000, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    packed, _ = load_model(path, torch.float32, "cpu", packed_from=gemma3_gguf)
    # Q4_K_M mixes formats, q/k/v and gate/up included: every one of them kept packed
    assert set(packed.packed_weights.formats) == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    ours = engine_logits(packed, tokens, 20, 7)
    del packed
    widened, _ = load_model(path, torch.float32, "cpu")
    ref = engine_logits(widened, tokens, 20, 7)
    assert _nmse(ours, ref) <= 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_gemma3_q4_k_m_greedy_matches_hf(gemma3_gguf):
    from transformers import AutoModelForCausalLM

    path = resolve_model(gemma3_gguf)
    llm = LLM(str(gemma3_gguf), quantization="gguf", dtype="float32", num_blocks=64)
    assert "kept packed" in llm.core.startup_line
    # the engine's tokenizer: AutoTokenizer.from_pretrained(path) too (a second load of the 262k vocabulary took ~6 s)
    prompt = llm.tokenizer("The three things an agent runtime schedules are")["input_ids"]
    got = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
    assert got == ref[: len(got)] and len(got) == 16


@requires_default_model
def test_the_served_engine_packed_matches_widened_greedy_and_logprobs():
    """The engine as served (bf16, the CPU default where it has AVX512-BF16; not the deterministic mode): a step of
    a few rows runs the C++ forward with its threads as one team, every projection from the packed blocks (1-4 rows
    by integer dot products, 5-64 over AMX panels; each thread folds a share of x into tile operands, which all of
    them read). Greedy tokens and their logprobs against the widened engine: a 13-token prompt alone (its prefill is
    such a step), then four prompts (one of 100 tokens) decoding together."""
    prompts = [[1, 504, 3458, 282, 4649, 314, 3570, 30, 378, 3458, 282, 4649, 314],
               [1, *torch.randint(300, 20000, (99,), generator=torch.Generator().manual_seed(3)).tolist()],
               [1, 504, 3458, 282, 4649, 314], [1, 378, 3458, 282, 4649, 314, 3570]]
    sp = SamplingParams(max_tokens=8, temperature=0, logprobs=True)
    got = {}
    for quantization in ("gguf", "none"):
        llm = LLM(str(gguf_source(None)), quantization=quantization, num_blocks=64, device="cpu", dtype="bfloat16")
        assert quantization == "none" or not llm.core.config.deterministic
        got[quantization] = [o.outputs[0] for o in llm.generate(prompts[:1], sp, progress=False)]
        got[quantization] += [o.outputs[0] for o in llm.generate(prompts, sp, progress=False)]
        llm.close()
    for packed, widened in zip(got["gguf"], got["none"]):
        n = next((i for i, (a, b) in enumerate(zip(packed.token_ids, widened.token_ids)) if a != b), 8)
        assert n >= 3, (packed.token_ids, widened.token_ids)  # a near-tie may part them later, never at once
        assert max(abs(a - b) for a, b in zip(packed.logprobs[:n], widened.logprobs[:n])) <= 0.15
