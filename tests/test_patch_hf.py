"""patch() on Hugging Face models: norms recognized by what they compute, replaced exactly.

Models are built from tiny configs (tools/hf_coverage.py); nothing is downloaded. The sweep
over every model type of the installed transformers is slow and runs only with
LAYERNORM_SLOW=1.
"""

import copy
import importlib.util
import math
import os
import pickle
import statistics
import sys
from pathlib import Path

import pytest
import torch

import layernorm
from layernorm.nn import _recognize

transformers = pytest.importorskip("transformers")


def _load_coverage():
    """tools/hf_coverage.py, the sweep's maintenance tool (outside the package)."""
    path = Path(__file__).parents[1] / "tools" / "hf_coverage.py"
    spec = importlib.util.spec_from_file_location("hf_coverage", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


coverage = _load_coverage()

#: one model per norm family: Llama, Gemma (1 + w), Gemma2, Qwen3 (per-head q/k), T5, OLMo
#: (no parameters), OLMo-2 (scale then cast), Cohere (layer norm, per-head), GPT-2 and BERT
#: and ViT (torch's LayerNorm), Phi-3
REPRESENTATIVE = [
    "llama",
    "gemma",
    "gemma2",
    "qwen3",
    "t5",
    "olmo",
    "olmo2",
    "cohere",
    "gpt2",
    "phi3",
    "bert",
    "vit",
]


@pytest.fixture(autouse=True, scope="module")
def _quiet():
    transformers.logging.set_verbosity_error()


@pytest.mark.parametrize("model_type", REPRESENTATIVE)
def test_family_replaced_and_exact(model_type):
    model, _ = coverage.build_model(model_type)
    family = coverage.Family(model_type)
    coverage.check_model(model, coverage.make_inputs(model), family)
    assert family.replaced > 0 and family.skipped == 0, family.reasons
    assert family.float32 <= 1e-5
    assert family.grads <= 1e-4
    assert family.steps <= 1e-5
    # bfloat16: the family's own rounding order, so (nearly) every logit is the same bits
    assert family.bf16_same >= 0.99
    ours, theirs = family.bf16_err
    assert ours <= 1.25 * theirs


def _llama(layers=2, **overrides):
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **overrides,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for m in model.modules():
            if "RMSNorm" in type(m).__name__:
                m.weight.uniform_(0.5, 1.5)
    return model


def test_unpatch_restores_class_attributes_and_bits():
    model = _llama()
    ids = torch.randint(0, 96, (1, 7))
    before = {n: (type(m), dict(vars(m))) for n, m in model.named_modules()}
    with torch.no_grad():
        want = model(ids).logits
    result = layernorm.patch(model)
    norm = model.model.norm
    assert isinstance(norm, transformers.models.llama.modeling_llama.LlamaRMSNorm)
    assert type(norm) is not before["model.norm"][0]
    assert repr(norm) == "LlamaRMSNorm((32,), eps=1e-06)"  # same name, same repr
    assert layernorm.unpatch(model) == list(result)
    after = {n: (type(m), dict(vars(m))) for n, m in model.named_modules()}
    assert after.keys() == before.keys()
    for name, (cls, attributes) in before.items():
        assert after[name][0] is cls
        assert after[name][1].keys() == attributes.keys()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)


def test_summary_names_replacements_and_reasons():
    class GatedNorm(torch.nn.Module):  # two inputs: left alone
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))

        def forward(self, x, gate):
            return torch.nn.functional.rms_norm(x * gate, (8,), self.weight)

    class L2Norm(torch.nn.Module):  # not a layer norm or an RMSNorm
        def forward(self, x):
            return x / x.norm(dim=-1, keepdim=True)

    class BF16Norm(torch.nn.Module):  # float32 matches, but it rounds in bfloat16 throughout
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    class BufferNorm(torch.nn.Module):  # its gain is a buffer, which a recipe cannot follow
        def __init__(self):
            super().__init__()
            self.register_buffer("gain", torch.ones(8))

        def forward(self, x):
            return torch.nn.functional.rms_norm(x, (8,), self.gain, 1e-6)

    llama_norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(8)
    unused = transformers.models.falcon_mamba.modeling_falcon_mamba.FalconMambaWeightlessRMSNorm(8)
    model = torch.nn.ModuleDict(
        {
            "a": llama_norm,
            "b": GatedNorm(),
            "c": L2Norm(),
            "d": torch.nn.GroupNorm(2, 8),
            "e": BF16Norm(),
            "f": torch.nn.LayerNorm(8),
            "g": BufferNorm(),
            "h": unused,  # a buffer the forward never reads: proven unused
        }
    )
    result = layernorm.patch(model)
    assert result == ["a", "f", "h"]
    reasons = {name: reason for name, _, reason in result.skipped}
    assert reasons["b"] == "forward takes 2 required inputs, not one"
    assert reasons["c"] == "matches no layer norm or RMSNorm over the trailing dims"
    assert reasons["d"] == "normalizes over the batch or channel groups, not the trailing dims"
    assert "bfloat16 rounding matches no casting order" in reasons["e"]
    assert reasons["g"] == "matches no layer norm or RMSNorm over the trailing dims"
    text = result.summary()
    assert text.startswith("3 modules of 3 classes replaced, 5 skipped")
    assert "replaced 1 x LlamaRMSNorm: rms_norm(eps=1e-06, weight, cast-then-scale)" in text
    assert layernorm.patch(model) == []  # already patched
    assert unused.__dict__["_layernorm_recipe"].shape is None  # any width, as its own forward
    assert layernorm.unpatch(model) == ["a", "f", "h"]


def test_unproven_dtypes_and_extra_arguments_run_the_module_own_forward():
    norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(16)
    layernorm.patch(norm)
    recipe = norm.__dict__["_layernorm_recipe"]
    assert (torch.float32, torch.float32) in recipe.dtypes
    assert (torch.bfloat16, torch.bfloat16) in recipe.dtypes
    assert (torch.float64, torch.float64) not in recipe.dtypes
    norm.double()
    x = torch.randn(3, 16, dtype=torch.float64)
    base = transformers.models.llama.modeling_llama.LlamaRMSNorm.forward
    assert torch.equal(norm(x), base(norm, x))  # float64: the module's own float32 path


def test_state_dict_and_save_pretrained_round_trip(tmp_path):
    model = _llama()
    ids = torch.randint(0, 96, (2, 9))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    layernorm.patch(model)
    assert list(model.state_dict()) == list(state)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    with torch.no_grad():
        patched = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values())  # no missing, unexpected or mismatched keys
    loaded.eval()
    with torch.no_grad():
        plain = loaded(ids).logits
    torch.testing.assert_close(patched, plain, rtol=1e-5, atol=1e-6)
    layernorm.patch(loaded)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, patched)


def test_generate_with_kv_cache_matches():
    model = _llama()
    prompt = torch.randint(0, 96, (1, 5))
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    want = model.generate(prompt, **kwargs)
    layernorm.patch(model)
    assert torch.equal(model.generate(prompt, **kwargs), want)


def test_torch_compile_traces_the_patched_norms():
    model = _llama(layers=1)
    ids = torch.randint(0, 96, (2, 6))
    with torch.no_grad():
        want = model(ids).logits
    layernorm.patch(model)
    compiled = torch.compile(model, backend="aot_eager")
    got = compiled(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.float().pow(2).mean().backward()
    assert model.model.norm.weight.grad is not None


def test_hf_trainer_steps_track_the_unpatched_model(tmp_path):
    pytest.importorskip("accelerate")  # transformers.Trainer needs it
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (8, 10), generator=generator)
    data = [{"input_ids": row, "labels": row} for row in ids]
    histories = []
    for patched in (False, True):
        model = _llama().train()
        if patched:
            assert len(layernorm.patch(model)) == 5
        arguments = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(patched)),
            max_steps=4,
            per_device_train_batch_size=2,
            learning_rate=1e-1,
            optim="sgd",  # Adam's g / sqrt(g^2) would magnify last-bit differences of tiny g
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
        )
        trainer = transformers.Trainer(model=model, args=arguments, train_dataset=data)
        trainer.train()
        histories.append(([h["loss"] for h in trainer.state.log_history if "loss" in h], model))
    (want, plain), (got, ours) = histories
    start = _llama().model.norm.weight
    assert len(want) == 4 and not torch.allclose(plain.model.norm.weight, start)  # it trained
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert _recognize.is_replaced(ours.model.norm)  # the trainer kept the patched modules
    for (name, p), q in zip(plain.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=name)


def test_layer_norm_subclass_without_bias_is_recognized():
    class CastingLayerNorm(torch.nn.LayerNorm):  # ESMC's: bias=False registers bias = None
        def forward(self, x):
            return super().forward(x).to(x.dtype)

    norm = CastingLayerNorm(16, bias=False)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 16)
    want, want_half = norm(x), norm(x.bfloat16())
    assert layernorm.patch(norm) == [""]
    assert norm.bias is None and list(norm.state_dict()) == ["weight"]
    torch.testing.assert_close(norm(x), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(norm(x.bfloat16()), want_half)


def test_casting_subclass_of_torch_layer_norm_is_recognized():
    class CastingLayerNorm(torch.nn.LayerNorm):
        def forward(self, x):
            return super().forward(x.float()).to(x.dtype)

    norm = CastingLayerNorm(8)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(4, 8)
    want = norm(x)
    assert layernorm.patch(norm) == [""]
    recipe = norm.__dict__["_layernorm_recipe"]
    assert recipe.describe() == "layer_norm(eps=1e-05, weight, bias, scale-then-cast)"
    torch.testing.assert_close(norm(x), want, rtol=1e-6, atol=1e-6)
    assert layernorm.unpatch(norm) == [""] and type(norm) is CastingLayerNorm


@pytest.mark.parametrize(
    ("order", "dtype"),
    [(o, d) for o in _recognize.ORDERS for d in (torch.float32, torch.bfloat16)],
)
def test_each_casting_order_matches_its_formula(order, dtype):
    """compute() against each order written out in torch ops, bfloat16 bits included."""
    torch.manual_seed(1)
    x = (torch.randn(64, 32) * 3).to(dtype)
    weight = (torch.rand(32) + 0.5).to(dtype)
    recipe = _recognize.Recipe("rms", (32,), 1e-6, "weight", 0.0, None, order)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
    if order == "scale-then-cast":
        want = (normed * weight.float()).to(dtype)
    else:  # cast-then-scale and t5 agree when x and the weight share a dtype
        want = weight * normed.to(dtype)
    got = _recognize.compute(recipe, x, weight, None)
    assert got.dtype == want.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert (got != want).double().mean() <= 0.01


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("LAYERNORM_SLOW") != "1", reason="set LAYERNORM_SLOW=1")
def test_every_model_type_of_the_installed_transformers():
    families = [coverage.survey(t, timeout=120) for t in coverage.model_types()]
    totals = coverage.totals(families)
    assert totals.replaced >= 0.95 * totals.in_scope
    checked = [f for f in families if f.replaced and f.float32 == f.float32]
    assert all(f.exact for f in checked), [f.model_type for f in checked if not f.exact]


def test_coverage_totals_count_modules_by_skip_reason():
    def family(name, classes, skips, error="", float32=math.nan):
        f = coverage.Family(name, error=error, float32=float32, grads=0.0, steps=0.0)
        f.classes = classes
        f.replaced = sum(r for r, _ in classes.values())
        f.skipped = sum(skips.values())
        f.skips, f.reasons = skips, list(skips)
        return f

    families = [
        family(
            "a",
            {"ARMSNorm": [9, 0], "BatchNorm2d": [0, 4], "AGated": [0, 2], "AOdd": [0, 1]},
            {
                "BatchNorm2d: normalizes over the batch or channel groups, not the trailing dims": 4,
                "AGated: forward takes 2 required inputs, not one": 2,
                "AOdd: matches no layer norm or RMSNorm over the trailing dims": 1,
            },
            float32=1e-7,
        ),
        family("b", {"LayerNorm": [5, 0]}, {}, error="unpatched forward: ValueError: x"),
        family("c", {}, {}, error="build: TypeError: y"),
        family("d", {"DNorm": [3, 0]}, {}, float32=1e-3),  # replaced, but the model differs
    ]
    t = coverage.totals(families)
    assert (t.families, t.built, t.with_norms) == (4, 3, 3)
    assert (t.replaced, t.unproven, t.out_of_scope, t.in_scope) == (17, 1, 6, 18)
    assert (t.checked_families, t.exact_families, t.exact) == (2, 1, 9)
    assert "17 (94.4%)" in coverage.table(families)


def test_patched_model_is_deep_copyable():
    model = _llama()
    layernorm.patch(model)
    clone = copy.deepcopy(model)
    assert _recognize.is_replaced(clone.model.norm)
    assert layernorm.unpatch(clone) == layernorm.unpatch(model)


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_patched_model_survives_torch_save_and_pickle(tmp_path, protocol):
    model = _llama()
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    layernorm.patch(model)
    with torch.no_grad():
        want = model(ids).logits
    path = tmp_path / "model.pt"
    torch.save(model, path, pickle_protocol=protocol)
    loaded = torch.load(path, weights_only=False)
    norm = loaded.model.norm
    assert type(norm) is type(model.model.norm) and _recognize.is_replaced(norm)
    assert repr(loaded) == repr(model)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)
    assert layernorm.unpatch(loaded) == layernorm.unpatch(model)
    assert type(norm) is transformers.models.llama.modeling_llama.LlamaRMSNorm
    layernorm.patch(loaded)  # plain pickle, its oldest protocol too
    again = pickle.loads(pickle.dumps(loaded.model.norm, protocol=0))
    assert _recognize.is_replaced(again) and again.state_dict().keys() == norm.state_dict().keys()


def test_model_bench_quick_runs_both_models(capsys, tmp_path):
    from layernorm.cli import main

    out = tmp_path / "model.txt"
    argv = ["bench", "--model", "llama", "--quick", "--model-repeat", "2", "--model-seconds", "0"]
    assert main([*argv, "--model-dtypes", "float32", "--model-out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text == out.read_text()
    lines = text.splitlines()
    assert lines[3].split()[:3] == ["dtype", "measurement", "unit"]
    rows = [line.split() for line in lines[4:]]
    assert [r[1] for r in rows] == ["forward", "forward+backward", "generate"]
    for r in rows:  # ... unpatched patched speedup low-high pairs norms -> norms
        plain, patched, speedup, interval, pairs = r[-8:-3]
        low, high = map(float, interval.split("-"))
        assert float(plain) > 0 and float(patched) > 0 and pairs == "2"
        assert low <= float(speedup.rstrip("x")) <= high
        assert float(r[-3]) > 0 and float(r[-1]) > 0  # time inside the norms, both models
    assert main([*argv, "--model-repeat", "0"]) == 2
    assert "--model-repeat must be >= 1" in capsys.readouterr().err
    assert main([*argv[:-1], "-1"]) == 2
    assert "--model-seconds must be >= 0" in capsys.readouterr().err


def test_median_interval_is_the_order_statistics_interval_of_the_median():
    from layernorm.report.model_bench import median_interval

    def coverage(n, k):  # P(x_(k+1) <= median <= x_(n-k)) for a continuous distribution
        return 1 - 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n

    assert median_interval([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    for n in range(1, 80):
        values = [float(v) for v in range(n, 0, -1)]
        median, low, high = median_interval(values)
        k = int(low) - 1
        assert median == statistics.median(values) and high == n - k
        assert coverage(n, k) >= 0.95 or k == 0  # covers 95%, or [min, max] is all there is
        assert k + 1 > (n - 1) // 2 or coverage(n, k + 1) < 0.95  # and is the narrowest such
    with pytest.raises(ValueError, match="at least one value"):
        median_interval([])


def test_the_report_s_whole_model_section_is_a_table_of_ratios():
    from layernorm.report import model_bench

    section = model_bench.report_section(quick=True)
    assert section.count("<tr>") == 4  # a header, then forward, forward+backward, generate
    assert "speedup" in section and "layernorm bench --model llama" in section
