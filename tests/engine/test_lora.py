"""LoRA adapters served unmerged (engine/lora.py) against HF transformers with the adapter merged into
its weights: greedy tokens of the base model and of two adapters (all seven projections; q and v only,
rsLoRA), alone and mixed in one batch, through the torch path, the fused one-call decode, multi-step
decode and n-gram drafts; the prefix cache keeps adapters apart; bad adapters are refused naming the problem."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from agentrt.engine import LLM, LoRARequest, SamplingParams
from agentrt.engine.sampling_params import InvalidRequestError
from agentrt.engine.testing import make_lora_adapter, make_tiny_model, merge_lora
from tests.conftest import assert_all_blocks_free

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("lora")
    model = make_tiny_model(root / "model", hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)
    cfg = AutoConfig.from_pretrained(model)
    full = make_lora_adapter(root / "full", cfg, rank=8, alpha=16, seed=1)
    qv = make_lora_adapter(root / "qv", cfg, rank=4, alpha=8, targets=("q_proj", "v_proj"), seed=2, std=0.2,
                           use_rslora=True)
    return model, {"full": full, "qv": qv}


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lengths]


def _hf_tokens(model_path, adapter, prompts, n=12):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    if adapter is not None:
        merge_lora(hf, adapter)
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False)
            outs.append(out[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def reference(setup):
    model, adapters = setup
    prompts = _prompts([5, 23, 40])  # under, across and over block boundaries (16)
    return prompts, {name: _hf_tokens(model, path, prompts) for name, path in [("base", None), *adapters.items()]}


def _llm(model, **kw):
    return LLM(str(model), dtype="float32", num_blocks=64, enable_lora=True, **kw)


def _requests(adapters):
    return {"base": None, "full": LoRARequest("full", 1, str(adapters["full"])),
            "qv": LoRARequest("qv", 2, str(adapters["qv"]))}


@pytest.mark.parametrize("kw", [{}, {"num_scheduler_steps": 4}, {"num_speculative_tokens": 3}],
                         ids=["one-step", "multi-step", "n-gram-drafts"])
def test_adapters_match_merged_hf_alone_and_mixed(setup, reference, kw):
    model, adapters = setup
    prompts, want = reference
    llm = _llm(model, **kw)
    reqs = _requests(adapters)
    for name, lr in reqs.items():  # each alone (single-sequence decode: the fused path for the base)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, lora_request=lr, progress=False)]
        assert got == want[name], name
    # every prompt under every adapter in one batch, interleaved
    order = [(name, i) for i in range(len(prompts)) for name in reqs]
    outs = llm.generate([prompts[i] for _, i in order], GREEDY, lora_request=[reqs[n] for n, _ in order],
                        progress=False)
    for (name, i), o in zip(order, outs, strict=True):
        assert o.outputs[0].token_ids == want[name][i], (name, i)
    assert_all_blocks_free(llm.core)


def test_adapters_change_outputs(reference):
    _, want = reference
    assert want["full"] != want["base"] and want["qv"] != want["base"] and want["full"] != want["qv"]


def test_prefix_cache_keeps_adapters_apart(setup):
    model, adapters = setup
    llm = _llm(model)
    reqs = _requests(adapters)
    prompt = _prompts([50], seed=5)[0]  # three full blocks
    one = SamplingParams(max_tokens=1, temperature=0)

    def hit(lr):
        return llm.generate([prompt], one, lora_request=lr, progress=False)[0].num_cached_tokens

    assert hit(None) == 0
    assert hit(reqs["full"]) == 0  # the base's blocks are not the adapter's
    assert hit(reqs["qv"]) == 0
    assert hit(reqs["full"]) == 48  # its own blocks are
    assert hit(None) == 48
    assert_all_blocks_free(llm.core)


def test_bad_adapters_are_refused_naming_the_problem(setup, tmp_path):
    model, adapters = setup
    llm = LLM(str(model), dtype="float32", num_blocks=16)
    lr = LoRARequest("full", 1, str(adapters["full"]))
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        llm.generate(["hi"], GREEDY, lora_request=lr, progress=False)
    llm = _llm(model, max_lora_rank=4)
    with pytest.raises(InvalidRequestError, match="rank 8, above max_lora_rank 4"):
        llm.generate(["hi"], GREEDY, lora_request=lr, progress=False)
    with pytest.raises(InvalidRequestError, match="not a directory"):
        llm.generate(["hi"], GREEDY, lora_request=LoRARequest("x", 3, str(tmp_path / "nope")), progress=False)

    def variant(name, edit_sd=None, edit_cfg=None):
        d = tmp_path / name
        d.mkdir()
        sd = load_file(str(adapters["qv"] / "adapter_model.safetensors"))
        cfg = json.loads((adapters["qv"] / "adapter_config.json").read_text())
        if edit_sd:
            edit_sd(sd)
        if edit_cfg:
            edit_cfg(cfg)
        save_file(sd, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps(cfg))
        return LoRARequest(name, 10 + len(name), str(d))

    def add_embed(sd):
        sd["base_model.model.model.embed_tokens.lora_A.weight"] = torch.zeros(4, 10)

    def wrong_shape(sd):
        k = next(k for k in sd if k.endswith("q_proj.lora_A.weight"))
        sd[k] = torch.zeros(4, 32)

    def drop_b(sd):
        del sd[next(k for k in sd if k.endswith("v_proj.lora_B.weight"))]

    cases = [(variant("embed", add_embed), "embed_tokens"), (variant("shape", wrong_shape), r"want \[r, 64\]"),
             (variant("halfpair", drop_b), "has lora_A but not lora_B"),
             (variant("dora", edit_cfg=lambda c: c.update(use_dora=True)), "use_dora"),
             (variant("save", edit_cfg=lambda c: c.update(modules_to_save=["lm_head"])), "modules_to_save")]
    for bad, match in cases:
        with pytest.raises(InvalidRequestError, match=match):
            llm.generate(["hi"], GREEDY, lora_request=bad, progress=False)
    llm.core.lora_adapter(LoRARequest("qv", 2, str(adapters["qv"])))
    with pytest.raises(InvalidRequestError, match="already names adapter 'qv'"):
        llm.core.lora_adapter(LoRARequest("other", 2, str(adapters["qv"])))
    with pytest.raises(InvalidRequestError, match="lora_int_id"):
        LoRARequest("x", 0, "/tmp")
    # nothing above was queued; the engine still serves
    assert llm.generate(["hi"], GREEDY, progress=False)[0].outputs[0].token_ids
    assert_all_blocks_free(llm.core)


def test_loaded_adapters_are_bounded(setup):
    model, adapters = setup
    llm = _llm(model, max_loras=1)
    a = llm.core.lora_adapter(LoRARequest("full", 1, str(adapters["full"])))
    llm.core.lora_adapter(LoRARequest("qv", 2, str(adapters["qv"])))
    assert [r.lora_name for r in llm.core.loras.loaded()] == ["qv"]
    # a request still holding the dropped adapter keeps serving with it
    out = llm.generate([[5, 6, 7]], GREEDY, lora_request=a, progress=False)
    assert len(out[0].outputs[0].token_ids) == 12
