"""patch()/unpatch(): torch's norms become this library's in place, and back, losing nothing."""

import copy

import pytest
import torch

import layernorm
import layernorm.nn.modules


def _encoder(norm_first: bool, final_norm: bool = True) -> torch.nn.TransformerEncoder:
    layer = torch.nn.TransformerEncoderLayer(
        16, 2, 32, dropout=0.0, batch_first=True, norm_first=norm_first
    )
    return torch.nn.TransformerEncoder(
        layer,
        2,
        norm=torch.nn.LayerNorm(16) if final_norm else None,
        enable_nested_tensor=False,
    )


def _randomize(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm | torch.nn.RMSNorm) and m.weight is not None:
                m.weight.uniform_(0.5, 1.5)
                if getattr(m, "bias", None) is not None:
                    m.bias.uniform_(-0.5, 0.5)


@pytest.fixture
def spy(monkeypatch):
    """Counts calls into this library's layer_norm / rms_norm from the modules."""
    calls = {"layer": 0, "rms": 0}
    real_ln, real_rms = layernorm.nn.modules.layer_norm, layernorm.nn.modules.rms_norm

    def ln(*args, **kwargs):
        calls["layer"] += 1
        return real_ln(*args, **kwargs)

    def rms(*args, **kwargs):
        calls["rms"] += 1
        return real_rms(*args, **kwargs)

    monkeypatch.setattr(layernorm.nn.modules, "layer_norm", ln)
    monkeypatch.setattr(layernorm.nn.modules, "rms_norm", rms)
    return calls


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_round_trip(norm_first, spy):
    model = _encoder(norm_first)
    _randomize(model)
    x = torch.randn(3, 5, 16)
    before = model(x)
    state = copy.deepcopy(model.state_dict())
    params = {name: p for name, p in model.named_parameters()}

    names = layernorm.patch(model)
    assert names == ["layers.0.norm1", "layers.0.norm2", "layers.1.norm1", "layers.1.norm2", "norm"]
    assert all(type(model.get_submodule(n)) is layernorm.LayerNorm for n in names)
    assert {n: p for n, p in model.named_parameters()} == params  # the same Parameter objects
    assert all(p is params[n] for n, p in model.named_parameters())
    patched_state = model.state_dict()
    assert list(patched_state) == list(state)
    assert all(torch.equal(patched_state[k], state[k]) for k in state)
    assert model.training and all(m.training for m in model.modules())
    patched = model(x)
    assert spy["layer"] == 5  # our forward really runs
    torch.testing.assert_close(patched, before, rtol=1e-5, atol=1e-5)

    assert layernorm.unpatch(model) == names
    assert all(type(model.get_submodule(n)) is torch.nn.LayerNorm for n in names)
    assert all(p is params[n] for n, p in model.named_parameters())
    spy["layer"] = 0
    assert torch.equal(model(x), before)  # torch's own norm again, bit for bit
    assert spy["layer"] == 0
    assert all(torch.equal(model.state_dict()[k], state[k]) for k in state)


def test_patch_keeps_modes_dtype_eps_and_flags():
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 6, dtype=torch.float64),
        torch.nn.LayerNorm(6, eps=1e-3, elementwise_affine=True, bias=False, dtype=torch.float64),
        torch.nn.LayerNorm(6, elementwise_affine=False),
        torch.nn.RMSNorm(6, eps=None),
        torch.nn.RMSNorm([2, 3], eps=1e-4, elementwise_affine=False),
    )
    model[1].eval()
    reprs = [repr(m) for m in model]
    assert layernorm.patch(model) == ["1", "2", "3", "4"]
    assert [repr(m) for m in model] == reprs
    assert isinstance(model[1], layernorm.LayerNorm) and isinstance(model[3], layernorm.RMSNorm)
    assert model[1].eps == 1e-3 and model[1].bias is None and model[1].weight.dtype == torch.float64
    assert not model[1].training and model[2].training
    assert model[2].weight is None and model[3].eps is None
    assert model[4].normalized_shape == (2, 3) and model[4].weight is None

    x = torch.randn(4, 6, dtype=torch.float64)
    want = torch.nn.functional.layer_norm(x, (6,), model[1].weight, None, 1e-3)
    torch.testing.assert_close(model[1](x), want)
    y = torch.randn(3, 2, 3)
    torch.testing.assert_close(
        model[4](y), torch.nn.functional.rms_norm(y, (2, 3), eps=1e-4), rtol=1e-6, atol=1e-6
    )


def test_unpatch_removes_the_options_set_while_patched():
    norm = torch.nn.RMSNorm(4)
    before = set(norm.__dict__)
    layernorm.patch(norm)
    norm.offset = 1.0  # an option of ours only
    assert "_options" in norm.__dict__
    assert layernorm.unpatch(norm) == [""] and type(norm) is torch.nn.RMSNorm
    assert set(norm.__dict__) == before  # nothing of ours is left behind
    x = torch.randn(3, 4)
    assert torch.equal(norm(x), torch.nn.functional.rms_norm(x, (4,), norm.weight))


def test_root_module_shared_module_and_idempotence():
    norm = torch.nn.LayerNorm(4)
    assert layernorm.patch(norm) == [""]
    assert isinstance(norm, layernorm.LayerNorm)
    assert layernorm.patch(norm) == []  # already ours
    assert layernorm.unpatch(norm) == [""] and type(norm) is torch.nn.LayerNorm
    assert layernorm.unpatch(norm) == []

    shared = torch.nn.LayerNorm(4)
    model = torch.nn.ModuleDict({"a": shared, "b": torch.nn.Sequential(shared)})
    assert layernorm.patch(model) == ["a"]  # one module, patched once
    assert isinstance(model["b"][0], layernorm.LayerNorm)


def test_leaves_native_modules_alone_and_recognizes_subclasses():
    class CastingLayerNorm(torch.nn.LayerNorm):
        def forward(self, x):
            return super().forward(x.float()).to(x.dtype)

    native = layernorm.LayerNorm(4)
    model = torch.nn.Sequential(CastingLayerNorm(4), native, torch.nn.LayerNorm(4))
    # the subclass's own forward is proven equivalent first (tests/test_patch_hf.py)
    assert layernorm.patch(model) == ["0", "2"]
    assert isinstance(model[0], CastingLayerNorm) and type(model[0]) is not CastingLayerNorm
    assert layernorm.unpatch(model) == ["0", "2"]
    assert type(model[0]) is CastingLayerNorm
    assert type(model[1]) is layernorm.LayerNorm  # built as ours: unpatch keeps it


def test_backend_choice_and_error():
    model = torch.nn.Sequential(torch.nn.LayerNorm(4))
    assert layernorm.patch(model, backend="torch") == ["0"]
    assert model[0].backend == "torch"
    torch.testing.assert_close(
        model[0](torch.ones(2, 4) * torch.arange(4)),
        torch.nn.functional.layer_norm(torch.ones(2, 4) * torch.arange(4), (4,)),
    )
    layernorm.unpatch(model)
    assert "backend" not in vars(model[0])
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        layernorm.patch(model, backend="cuda")
    assert type(model[0]) is torch.nn.LayerNorm  # nothing patched on error


def test_optimizer_and_checkpoints_survive_patch():
    model = _encoder(norm_first=True, final_norm=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    layernorm.patch(model)
    weight = model.layers[0].norm1.weight
    before = weight.detach().clone()
    model(torch.randn(2, 3, 16)).pow(2).sum().backward()
    optimizer.step()
    assert not torch.equal(weight, before)  # the optimizer still holds the same Parameter
    fresh = _encoder(norm_first=True, final_norm=False)
    fresh.load_state_dict(model.state_dict())  # a patched checkpoint loads into plain torch
    layernorm.unpatch(model)
    x = torch.randn(2, 3, 16)
    assert torch.equal(fresh(x), model(x))


def _hf_models():
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install transformers)"
    )
    bert = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=50,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=16,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )
    gpt2 = transformers.GPT2Model(
        transformers.GPT2Config(
            vocab_size=50,
            n_embd=32,
            n_layer=2,
            n_head=2,
            n_positions=16,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    return {"bert": bert, "gpt2": gpt2}


@pytest.mark.parametrize("which", ["bert", "gpt2"])
def test_hugging_face_model_round_trip(which, spy):
    model = _hf_models()[which].eval()
    _randomize(model)
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        before = model(input_ids=ids).last_hidden_state
    state = copy.deepcopy(model.state_dict())
    expected = [n for n, m in model.named_modules() if type(m) is torch.nn.LayerNorm]
    assert len(expected) == 5  # bert: embeddings + 2 per layer; gpt2: 2 per layer + ln_f

    assert layernorm.patch(model) == expected
    assert not model.training
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    with torch.no_grad():
        patched = model(input_ids=ids).last_hidden_state
    assert spy["layer"] == len(expected)
    torch.testing.assert_close(patched, before, rtol=1e-5, atol=1e-5)

    assert layernorm.unpatch(model) == expected
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).last_hidden_state, before)
