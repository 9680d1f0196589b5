"""What :func:`layernorm.patch` does to the installed transformers' models: build, patch, compare.

``python tools/hf_coverage.py [--out docs/hf_coverage.md] [--only llama,t5] [--limit N]``
builds every model of the installed ``transformers`` that has a causal-LM, seq2seq-LM,
masked-LM, image-classification, CTC or audio-classification head, from its default config
shrunk to a tiny size (:func:`tiny_config`; no download, no ``from_pretrained``), patches it,
and checks it against an unpatched copy (:func:`check_model`):

- float32: logits within ``1e-5`` relative (to the largest logit), gradients of every parameter
  within ``1e-4`` relative (to the largest gradient of that parameter), three SGD steps whose
  losses agree within ``1e-5`` relative;
- bfloat16: the share of logits bitwise equal to the unpatched model's, and both models'
  largest error against the float64 model (relative to its largest logit).

The table it writes says, per family: the norm classes, the modules replaced and skipped, the
reason of each skip, and the checks. A family that fails to build, or whose forward needs
inputs this module does not make (multimodal prompts, say), is listed with the error; its
norms are still counted from the built model when it builds.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from layernorm.nn.patch import PatchResult, patch

__all__ = ["Family", "build_model", "check_model", "main", "survey", "tiny_config"]

#: config attribute -> tiny value (set only where the config has the attribute)
_TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "d_model": 64,
    "d_ff": 128,
    "d_kv": 16,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "num_heads": 4,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_inner": 128,
    "n_positions": 128,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "image_size": 32,
    "patch_size": 8,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "embed_dim": 64,
}
_VOCAB = 512
#: per-family config values no general rule gives
_FAMILY: dict[str, dict[str, Any]] = {
    # the yes/no answer tokens' ids default (outside the config) beyond the shrunk vocabulary
    "shieldgemma2": {"yes_token_index": 100, "no_token_index": 101},
    # levit's stem always downsamples 16x: its patch size is that, not a setting
    "levit": {"patch_size": 16, "image_size": 64},
}
_TASKS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_CTC_MAPPING_NAMES",
    "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
)
_MAX_PARAMETERS = 30_000_000


def _integers(config: Any) -> dict[str, int]:
    return {
        name: value
        for name, value in vars(config).items()
        if isinstance(value, int) and not isinstance(value, bool)
    }


def _set(config: Any, name: str, value: Any) -> None:
    with contextlib.suppress(Exception):
        setattr(config, name, value)


def _keep_derived(config: Any, before: dict[str, int]) -> None:
    """Re-derives the sizes that the shrunk ones determined, from ``before`` (the originals).

    - sizes named ``*dim*`` that were equal stay equal (MLA's ``head_dim`` is its
      ``qk_rope_head_dim``), at the smaller tiny value;
    - a ``*dim*`` size left alone that equalled a shrunk one (or the width), or the sum of two
      (``qk_head_dim = qk_nope_head_dim + qk_rope_head_dim``), follows them;
    - other per-head sizes (``rotary_dim``, ``linear_head_dim``, ``mamba_d_head``) are capped
      at the tiny head size, 16;
    - other ``*hidden_size`` sizes that were the width or a multiple of it stay that multiple
      (a decoder's ``cross_attention_hidden_size`` is its encoder's width);
    - expert groups collapse to one, and a missing experts-per-token becomes 2;
    - state-space heads times their size stay ``expand * hidden_size``;
    - multi-head attention stays multi-head (MLA repeats no key-value heads).
    """
    after = _integers(config)
    for heads, kv_heads in (
        ("num_attention_heads", "num_key_value_heads"),
        ("decoder_attention_heads", "num_key_value_heads"),
    ):
        if heads in before and kv_heads in before and before[heads] == before[kv_heads]:
            _set(config, kv_heads, after[heads])
    widths = {n for n in ("hidden_size", "d_model", "n_embd") if after.get(n) != before.get(n)}
    shrunk = {n for n in after if n in before and after[n] != before[n] and "dim" in n}
    for name in sorted(shrunk):
        twins = [n for n in shrunk if before[n] == before[name]]
        _set(config, name, min(getattr(config, n) for n in twins))
    after = _integers(config)
    for name, value in after.items():
        if name in shrunk or "dim" not in name or name not in before or value != before[name]:
            continue
        equal = [n for n in sorted(shrunk | widths) if before[n] == value]
        sums = [
            (a, b) for a in sorted(shrunk) for b in sorted(shrunk) if before[a] + before[b] == value
        ]
        if equal:
            _set(config, name, after[equal[0]])
        elif sums:
            _set(config, name, after[sums[0][0]] + after[sums[0][1]])
        elif value > 16 and ("head" in name or name == "rotary_dim"):
            _set(config, name, 16)
    new, old = after.get("hidden_size", 0), before.get("hidden_size", 0)
    for name, value in after.items():  # attention_hidden_size = 2 * hidden_size, say
        scaled = name.endswith("_hidden_size") and value == before.get(name)
        if scaled and new < old and value >= old and value % old == 0:
            _set(config, name, value // old * new)
    experts = min(
        (
            v
            for n, v in after.items()
            if n in ("num_experts", "num_local_experts", "n_routed_experts")
        ),
        default=None,
    )
    if experts is not None and getattr(config, "num_experts_per_tok", 0) is None:
        _set(config, "num_experts_per_tok", 2)
    for name in ("n_group", "num_expert_group", "topk_group"):
        if experts is not None and after.get(name, 0) > 1:  # groups of experts
            _set(config, name, 1)
    after = _integers(config)
    for heads, size, expand in (
        ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
        ("num_heads", "head_dim", "expand"),
    ):
        if (
            all(n in before for n in (heads, size, expand, "hidden_size"))
            and before[heads] * before[size] == before[expand] * before["hidden_size"]
        ):
            inner = after[expand] * after["hidden_size"]
            if inner % after[size] == 0:
                _set(config, heads, inner // after[size])


#: per-stage lists :func:`_shrink_stages` keeps consistent; a config with others is left alone
_STAGE_LISTS = {
    "hidden_sizes",
    "depths",
    "num_heads",
    "num_attention_heads",
    "key_dim",
    "mlp_ratio",
    "attention_ratio",
    "down_ops",
    "stage_names",
}


def _shrink_stages(config: Any) -> None:
    """Shrinks per-stage size lists (convolutional and pyramid vision models) in proportion.

    Widths (``hidden_sizes``) are divided by the smallest power of two that brings the widest
    stage to 64 at most, or the narrowest to 128, so ratios and divisibility by powers of two
    survive; depths become 1
    per stage; the number of stages is kept (other per-stage lists have that length). A first
    stage whose width (``embed_dim``) its heads do not divide gets heads of size 16. Attention
    windows become 2 patches wide, and the image as wide as one window at the last stage
    (windows smaller than the full-size ones break in the model's clamping of them).
    """
    others = [
        n
        for n, v in vars(config).items()
        if isinstance(v, list | tuple) and not n.startswith("_") and n not in _STAGE_LISTS
    ]
    if others:  # per-stage channels or per-layer kernels that would have to follow
        return
    widths: Any = getattr(config, "hidden_sizes", None)
    if _ints(widths) and max(widths) > 64:
        factor = 1  # the narrowest stage keeps 128: a bottleneck quarter of 32 groups of norms
        while max(widths) / factor > 64 and min(widths) / factor >= 256:
            factor *= 2
        _set(config, "hidden_sizes", type(widths)(max(w // factor, 1) for w in widths))
    depths: Any = getattr(config, "depths", None)
    if _ints(depths) and max(depths) > 1:
        _set(config, "depths", type(depths)(1 for _ in depths))
    if _ints(depths) and isinstance(getattr(config, "num_stages", None), int):
        _set(config, "num_stages", len(depths))  # an alias of the shrunk num_hidden_layers
    heads: Any = getattr(config, "num_heads", None)
    width = getattr(config, "embed_dim", None)
    if _ints(heads) and isinstance(width, int) and width % heads[0]:
        _set(config, "embed_dim", 16 * heads[0])  # stage i: 2**i times the heads and width
    window, patch = getattr(config, "window_size", None), getattr(config, "patch_size", None)
    if _ints(depths) and isinstance(window, int) and isinstance(patch, int) and window > 2:
        # the last stage's patch grid is one window, as in the full-size configs
        _set(config, "window_size", 2)
        _set(config, "image_size", patch * 2 ** len(depths))


def _ints(value: Any) -> bool:
    return (
        isinstance(value, list | tuple)
        and bool(value)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )


def _shrink(config: Any, depth: int = 0, mixed: bool = True) -> None:
    before = _integers(config)
    for name, value in _TINY.items():
        current = getattr(config, name, None)
        if isinstance(current, int) and not isinstance(current, bool) and current > value:
            with contextlib.suppress(Exception):
                setattr(config, name, value)
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and vocab > _VOCAB:
        with contextlib.suppress(Exception):
            config.vocab_size = _VOCAB
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            token = getattr(config, name, None)
            if isinstance(token, int) and token >= _VOCAB:
                with contextlib.suppress(Exception):
                    setattr(config, name, _VOCAB - 1)
    conv = getattr(config, "conv_dim", None)
    if isinstance(conv, list | tuple) and conv and max(conv) > 32:
        with contextlib.suppress(Exception):
            config.conv_dim = type(conv)(32 for _ in conv)
    _shrink_stages(config)
    for name in ("layer_types", "mlp_layer_types"):
        types = getattr(config, name, None)
        if isinstance(types, list) and len(types) > 2:
            # keep two kinds of layer where there are two (linear and full attention, say)
            other = next((t for t in types if t != types[0] and mixed), types[1])
            with contextlib.suppress(Exception):
                setattr(config, name, [types[0], other])
    types = getattr(config, "layers_block_type", None)
    if isinstance(getattr(config, "hybrid_layer_ids", None), list) and isinstance(types, list):
        _set(config, "hybrid_layer_ids", [i for i, t in enumerate(types) if t == "hybrid"])
    languages = getattr(config, "languages", None)
    if languages and getattr(config, "default_language", "") is None:
        _set(config, "default_language", languages[0])  # adapters pick one when inputs don't
    for name, value in _FAMILY.get(getattr(config, "model_type", ""), {}).items():
        _set(config, name, value)
    _keep_derived(config, before)
    if getattr(config, "use_cache", None) is True:
        # one forward, no generation: hybrid caches with no attention layer cannot count tokens
        with contextlib.suppress(Exception):
            config.use_cache = False
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout"):
        if isinstance(getattr(config, name, None), float):
            with contextlib.suppress(Exception):
                setattr(config, name, 0.0)
    if depth < 3:
        for value in list(vars(config).values()):
            if hasattr(value, "to_dict") and hasattr(value, "model_type"):
                _shrink(value, depth + 1, mixed)


#: token ids clamped into the shrunk vocabulary sit in its last few ids, which inputs avoid
_SPECIAL = 8


def _clamp_tokens(config: Any) -> None:
    """Moves token ids (``image_token_index``, ``boi_token_id``) beyond the shrunk vocabulary
    into its last :data:`_SPECIAL` ids, distinct ids staying distinct."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if not isinstance(vocab, int):
        return
    configs = [config] + [
        v for v in vars(config).values() if hasattr(v, "to_dict") and hasattr(v, "model_type")
    ]
    moved: dict[int, int] = {}
    for c in configs:
        for name, value in _integers(c).items():
            if "token" in name and ("id" in name or "index" in name) and value >= vocab:
                if value not in moved:
                    moved[value] = vocab - 1 - len(moved) % _SPECIAL
                _set(c, name, moved[value])


def tiny_config(model_type: str, mixed: bool = True) -> Any:
    """The default config of ``model_type``, shrunk (hidden 64, 2 layers, 4 heads, ...).

    Sizes derived from the shrunk ones are kept consistent with them. With ``mixed``, a
    ``layer_types`` list keeps its first type and the first other type (a linear-attention and
    a full-attention layer, say); without, its first two.
    """
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    _shrink(config, mixed=mixed)
    _clamp_tokens(config)
    with contextlib.suppress(Exception):
        config._attn_implementation = "eager"
    return config


def _model_class(model_type: str) -> tuple[str, type] | None:
    import transformers
    from transformers.models.auto import modeling_auto

    for task in _TASKS:
        name = getattr(modeling_auto, task).get(model_type)
        if isinstance(name, tuple | list):
            name = name[0]
        if name and hasattr(transformers, name):
            return task.removeprefix("MODEL_FOR_").removesuffix("_MAPPING_NAMES").lower(), getattr(
                transformers, name
            )
    return None


def model_types() -> list[str]:
    """Every model type with a head this module builds, sorted."""
    from transformers.models.auto import modeling_auto

    types: set[str] = set()
    for task in _TASKS:
        types.update(getattr(modeling_auto, task))
    return sorted(types)


def build_model(model_type: str, seed: int = 0) -> tuple[torch.nn.Module, str]:
    """A tiny float32 model of ``model_type`` in eval mode, and its task."""
    found = _model_class(model_type)
    if found is None:
        raise LookupError(f"no supported head for {model_type}")
    task, cls = found
    config = tiny_config(model_type)
    try:
        with torch.device("meta"):
            meta = cls(config)
    except Exception:  # the default config may not define every kind of layer it lists
        config = tiny_config(model_type, mixed=False)
        with torch.device("meta"):
            meta = cls(config)
    count = sum(p.numel() for p in meta.parameters())
    if count > _MAX_PARAMETERS:
        raise MemoryError(f"{count / 1e6:.0f}M parameters after shrinking")
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # gains of ones and zeros would hide a wrong offset or bias
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None and p.dim() == 1 and "norm" in type(module).__name__.lower():
                    p.copy_(torch.rand(p.shape, generator=generator) * 0.5 + 0.75)
                    if "bias" in name:
                        p.sub_(1.0)
    return model, task


#: spectrogram features per mel bin where a family's feature extractor stacks frames:
#: granite_speech5 appends deltas (x2) and stacks pairs of frames (x2)
_STACKED = {"granite_speech5_ctc": 4}


def _features(config: Any) -> Any:
    """The config, or sub-config (``audio_config``, ``encoder_config``), with mel bins."""
    if hasattr(config, "num_mel_bins"):
        return config
    for value in vars(config).values():
        if hasattr(value, "to_dict") and hasattr(value, "num_mel_bins"):
            return value
    return None


def make_inputs(model: torch.nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs for ``model``'s forward: token ids, pixels or audio, by its main input.

    Spectrograms take their mel bins from the config (or its audio sub-config) and are laid
    out (batch, bins, frames); :func:`_variants` gives the other layouts that
    :func:`survey` tries when a model's forward rejects these.
    """
    import inspect

    config: Any = model.config
    generator = torch.Generator().manual_seed(seed)
    main = getattr(model, "main_input_name", "input_ids")
    features = _features(config)
    bins = getattr(features, "num_mel_bins", 80)
    if main == "input_ids":
        vocab = getattr(config, "vocab_size", None) or getattr(
            config.get_text_config(), "vocab_size", _VOCAB
        )
        high = min(int(vocab or _VOCAB), _VOCAB) - _SPECIAL
        inputs = {"input_ids": torch.randint(3, high, (2, 12), generator=generator)}
        if getattr(config, "is_encoder_decoder", False):
            inputs["decoder_input_ids"] = inputs["input_ids"][:, :6].clone()
        return inputs
    if main == "pixel_values":
        vision = getattr(config, "vision_config", None) or config
        channels = getattr(vision, "num_channels", 3)
        size = getattr(vision, "image_size", 32)
        size = size if isinstance(size, int) else size[0]
        if "spatial_shapes" in inspect.signature(model.forward).parameters:
            # native-resolution vision (NaFlex): pixels come as a 4 x 4 grid of flat patches
            patch = getattr(vision, "patch_size", 16)
            return {
                "pixel_values": torch.randn(2, 16, channels * patch * patch, generator=generator),
                "pixel_attention_mask": torch.ones(2, 16, dtype=torch.long),
                "spatial_shapes": torch.tensor([[4, 4], [4, 4]]),
            }
        return {"pixel_values": torch.randn(2, channels, size, size, generator=generator)}
    if main == "input_values":
        if features is not None:  # a spectrogram (batch, frames, bins), not a waveform
            frames = getattr(features, "max_length", 64)
            return {"input_values": torch.randn(2, frames, bins, generator=generator)}
        return {"input_values": torch.randn(2, 1600, generator=generator)}
    if main == "input_features":
        frames = 2 * getattr(features or config, "max_source_positions", 32)
        bins *= _STACKED.get(getattr(config, "model_type", ""), 1)
        return {"input_features": torch.randn(2, bins, frames, generator=generator)}
    raise LookupError(f"no inputs for main input {main!r}")


def _variants(
    model: torch.nn.Module, inputs: dict[str, torch.Tensor]
) -> list[dict[str, torch.Tensor]]:
    """Other layouts of ``inputs``' audio: spectrograms (batch, frames, bins), waveforms with
    a channel dimension; tokens with the audio a streaming speech-to-text model requires."""
    import inspect

    variants = []
    config: Any = model.config
    features = _features(config)
    takes = inspect.signature(model.forward).parameters
    if "input_ids" in inputs and features is not None and "input_features" in takes:
        frames = 12 * getattr(config, "audio_length_per_tok", 8)  # frames per token
        audio = torch.randn(2, features.num_mel_bins, frames, generator=torch.Generator())
        variants.append({**inputs, "input_features": audio})
    if "input_features" in inputs and inputs["input_features"].dim() == 3:
        variants.append({**inputs, "input_features": inputs["input_features"].transpose(1, 2)})
    if "input_values" in inputs and inputs["input_values"].dim() == 2:
        variants.append({**inputs, "input_values": inputs["input_values"].unsqueeze(1)})
    return variants


def _logits(output: Any) -> torch.Tensor:
    for name in ("logits", "prediction_logits", "last_hidden_state"):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, torch.Tensor):
        return output
    for value in output.to_tuple() if hasattr(output, "to_tuple") else output:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value
    raise LookupError("no floating-point output")


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@dataclass
class Family:
    """One model type's row of the coverage table."""

    model_type: str
    task: str = ""
    classes: dict[str, list[int]] = field(default_factory=dict)  # class -> [replaced, skipped]
    replaced: int = 0
    skipped: int = 0
    reasons: list[str] = field(default_factory=list)  # "class: reason", first seen first
    skips: dict[str, int] = field(default_factory=dict)  # "class: reason" -> modules
    recipes: list[str] = field(default_factory=list)
    error: str = ""
    float32: float = math.nan  # logits, relative
    grads: float = math.nan  # worst parameter, relative
    steps: float = math.nan  # losses of three SGD steps, relative
    bf16_same: float = math.nan  # share of logits bitwise equal
    bf16_err: tuple[float, float] = (math.nan, math.nan)  # (patched, unpatched) vs float64
    seconds: float = 0.0

    def count(self, result: PatchResult) -> None:
        """Takes the modules replaced and skipped (with their reasons) from ``result``."""
        self.replaced, self.skipped = len(result), len(result.skipped)
        self.classes, self.recipes, self.reasons, self.skips = {}, [], [], {}
        for _, cls, what in result.replaced:
            self.classes.setdefault(cls, [0, 0])[0] += 1
            if what not in self.recipes:
                self.recipes.append(what)
        for _, cls, reason in result.skipped:
            self.classes.setdefault(cls, [0, 0])[1] += 1
            key = f"{cls}: {reason}"
            if key not in self.skips:
                self.reasons.append(key)
            self.skips[key] = self.skips.get(key, 0) + 1

    @property
    def exact(self) -> bool:
        return self.float32 <= 1e-5 and self.grads <= 1e-4 and self.steps <= 1e-5


def check_model(model: torch.nn.Module, inputs: dict[str, torch.Tensor], family: Family) -> None:
    """Patches a copy of ``model`` and fills ``family``'s checks against ``model`` itself."""
    patched = copy.deepcopy(model)
    result = patch(patched)
    family.count(result)
    if not result:
        return
    # three SGD steps on each; the first step's logits and gradients are compared
    runs = []
    for m in (copy.deepcopy(model), copy.deepcopy(patched)):
        optimizer = torch.optim.SGD(m.parameters(), lr=1e-2)
        trace: list[float] = []
        first = torch.empty(0)
        grads: dict[str, torch.Tensor] = {}
        for step in range(3):
            optimizer.zero_grad(set_to_none=True)
            logits = _logits(m(**inputs))
            loss = logits.float().pow(2).mean()
            loss.backward()
            if step == 0:
                first = logits.detach()
                grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
            optimizer.step()
            trace.append(float(loss.detach()))
        runs.append((first, grads, trace))
    (want, want_grads, want_trace), (got, got_grads, got_trace) = runs
    family.float32 = _relative(got, want)
    # relative to the parameter's largest gradient, floored at 1e-3 of the model's largest:
    # a gradient that is zero in exact arithmetic is rounding noise in both models
    largest = max(float(g.abs().max()) for g in want_grads.values())
    worst = 0.0
    for name, g in want_grads.items():
        other = got_grads.get(name)
        if other is None:
            worst = math.inf
            break
        scale = max(float(g.abs().max()), 1e-3 * largest, 1e-30)
        worst = max(worst, float((other.double() - g.double()).abs().max()) / scale)
    family.grads = worst
    family.steps = max(
        abs(a - b) / max(abs(b), 1e-30) for a, b in zip(got_trace, want_trace, strict=True)
    )

    with torch.no_grad():
        try:
            truth = _logits(copy.deepcopy(model).double()(**_cast(inputs, torch.float64)))
        except RuntimeError:  # some kernels (MoE grouped matmuls) have no float64
            truth = want
        low = _cast(inputs, torch.bfloat16)
        plain = _logits(copy.deepcopy(model).bfloat16()(**low))
        ours = _logits(copy.deepcopy(patched).bfloat16()(**low))
    family.bf16_same = float((plain == ours).double().mean())
    family.bf16_err = (_relative(ours, truth), _relative(plain, truth))


def _cast(inputs: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}


class _Timeout(BaseException):
    pass


def _alarm(_signum: int, _frame: Any) -> None:
    signal.alarm(5)  # again, in case C code (numba's compiler callbacks) swallows this one
    raise _Timeout


def survey(model_type: str, timeout: int = 120) -> Family:
    """Builds, patches and checks one model type; errors go into the row, never out."""
    family = Family(model_type)
    start = time.perf_counter()
    use_alarm = hasattr(signal, "SIGALRM")
    if use_alarm:
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(timeout)
    try:
        model, family.task = build_model(model_type)
        inputs = make_inputs(model)
        first: Exception | None = None
        for candidate in [inputs, *_variants(model, inputs)]:
            try:
                with torch.no_grad():
                    _logits(model(**candidate))
            except Exception as error:  # the inputs made here do not fit this model
                first = first or error
                continue
            inputs, first = candidate, None
            break
        if first is not None:
            family.count(patch(model))
            family.error = f"unpatched forward: {type(first).__name__}: {_short(first)}"
            return family
        try:
            check_model(model, inputs, family)
        except _Timeout:
            raise
        except Exception as error:
            family.error = f"check: {type(error).__name__}: {_short(error)}"
            if family.replaced == 0 and not family.classes:
                family.count(patch(model))
    except _Timeout:
        family.error = f"over {timeout} s"
    except Exception as error:
        family.error = f"build: {type(error).__name__}: {_short(error)}"
    finally:
        if use_alarm:
            signal.alarm(0)
        family.seconds = time.perf_counter() - start
    return family


def _short(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text[:120] + ("..." if len(text) > 120 else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


#: skip reasons saying a module is not one input's layer norm or RMSNorm over trailing dims,
#: whatever its name says: batch and group norms, containers, gated and weight norms
OUT_OF_SCOPE = (
    "normalizes over the batch or channel groups",
    "has submodules",
    "required inputs, not one",
)


@dataclass
class Totals:
    """The coverage table's totals, over families that built.

    ``in_scope`` counts the norm modules that are layer norms or RMSNorms by what they take
    (everything but the :data:`OUT_OF_SCOPE` skips): ``replaced`` of them were, ``exact`` of
    those sit in families whose whole model was checked exact (:attr:`Family.exact`), and
    ``unproven`` were skipped for another reason.
    """

    families: int
    built: int
    with_norms: int
    replaced: int
    unproven: int
    out_of_scope: int
    checked_families: int
    exact_families: int
    exact: int

    @property
    def in_scope(self) -> int:
        return self.replaced + self.unproven


def totals(families: list[Family]) -> Totals:
    """Sums ``families``' rows (see :class:`Totals`)."""
    built = [f for f in families if not f.error.startswith("build")]
    out = sum(n for f in built for r, n in f.skips.items() if any(o in r for o in OUT_OF_SCOPE))
    checked = [f for f in built if f.replaced and not math.isnan(f.float32)]
    exact = [f for f in checked if f.exact]
    return Totals(
        families=len(families),
        built=len(built),
        with_norms=sum(1 for f in built if f.replaced + f.skipped),
        replaced=sum(f.replaced for f in built),
        unproven=sum(f.skipped for f in built) - out,
        out_of_scope=out,
        checked_families=len(checked),
        exact_families=len(exact),
        exact=sum(f.replaced for f in exact),
    )


def table(families: list[Family]) -> str:
    """The markdown document: totals, then one row per family."""
    import transformers

    t = totals(families)
    share = 100 * t.replaced / max(t.in_scope, 1)
    lines = [
        "# What `layernorm.patch` does to Hugging Face models",
        "",
        f"Generated by `python tools/hf_coverage.py` with transformers "
        f"{transformers.__version__} and torch {torch.__version__}: every model type with a "
        "causal-LM, seq2seq-LM, masked-LM, image-classification, CTC or audio-classification "
        "head, built from its default config shrunk to a tiny size (hidden 64, 2 layers), "
        "patched, and compared with its unpatched self (see the module's docstring for the "
        "checks).",
        "",
        f"- Model types tried: {t.families}; built: {t.built}; with norm modules: {t.with_norms}.",
        f"- Layer norms and RMSNorms (norm modules but batch and group norms, containers and "
        f"two-input norms such as gated ones, {t.out_of_scope} modules): {t.in_scope}; "
        f"replaced: {t.replaced} ({share:.1f}%), each proven equal to its own forward by "
        f"probes; skipped as unproven: {t.unproven}.",
        f"- Families whose whole model was checked: {t.checked_families}; exact in float32 "
        f"(logits 1e-5, gradients 1e-4, three SGD steps 1e-5): {t.exact_families}, holding "
        f"{t.exact} of the replaced modules. The others' forwards need inputs this module "
        "does not make (see the notes).",
        "",
        "Columns: modules replaced / skipped; float32 logits error (relative to the largest "
        "logit); worst parameter gradient error; bfloat16: share of logits bitwise equal to "
        "the unpatched model's, then the error of patched / unpatched against float64.",
        "",
        "| family | task | norm classes | repl. | skip. | f32 logits | grads | bf16 same | "
        "bf16 err vs f64 (ours / theirs) | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in sorted(families, key=lambda f: f.model_type):
        classes = ", ".join(f"{c} ({r}/{s})" for c, (r, s) in f.classes.items())

        def num(v: float, fmt: str = ".1e") -> str:
            return "" if math.isnan(v) else format(v, fmt)

        notes = "; ".join([*f.reasons, *([f.error] if f.error else [])])
        lines.append(
            f"| {f.model_type} | {f.task} | {_cell(classes)} | {f.replaced} | {f.skipped} | "
            f"{num(f.float32)} | {num(f.grads)} | {num(f.bf16_same, '.4f')} | "
            f"{num(f.bf16_err[0], '.2e')} / {num(f.bf16_err[1], '.2e')} | {_cell(notes)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/hf_coverage.py", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/hf_coverage.md"))
    parser.add_argument("--only", help="comma-separated model types (default: all)")
    parser.add_argument("--limit", type=int, help="at most this many model types")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per model type")
    args = parser.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    types = args.only.split(",") if args.only else model_types()
    if args.limit:
        types = types[: args.limit]
    families = []
    for i, model_type in enumerate(types):
        family = survey(model_type, args.timeout)
        families.append(family)
        print(
            f"[{i + 1}/{len(types)}] {model_type}: {family.replaced} replaced, "
            f"{family.skipped} skipped, f32 {family.float32:.1e} {family.error[:80]} "
            f"({family.seconds:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table(families))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
