"""Where weights come from: a Hugging Face Qwen2 checkpoint directory, an in-memory transformers model, or
Qwen2.5-1.5B's exact shape with seeded random weights (no weights can be downloaded)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from .model import ModelShape, Qwen2

REPO = Path(__file__).resolve().parent.parent


def models_dir() -> Path:
    """Where the embedded small models are: golden/models in a checkout (an editable install too); once installed,
    the `stepgate_models` package data beside this package."""
    for d in (REPO / "golden" / "models", REPO / "stepgate_models"):
        if d.is_dir():
            return d
    return REPO / "golden" / "models"


MODELS_DIR = models_dir()
SMALL_MODEL_DIR = MODELS_DIR / "qwen2-small"
# The same shape trained (scripts/train_small_model.py) so that its greedy decisions have wide margins: the fp16
# gates' subject on a GPU, where the random-weight `small` model's logit gaps drown in fp16 rounding.
SMALL_TRAINED_DIR = MODELS_DIR / "qwen2-small-trained"
NAMED_MODELS = {"small": SMALL_MODEL_DIR, "small-trained": SMALL_TRAINED_DIR}


RANDOM_1P5B = "qwen2.5-1.5b-random"

# Qwen2.5-1.5B's config.json, less what does not change the shape.
QWEN25_1P5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                   num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                   rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu")
# Up to this many parameters a model is "small": its steps take milliseconds on one CPU core, so it is served the
# CPU-scaled workloads on every device. The embedded models are far below it, Qwen2.5-0.5B far above.
SMALL_MAX_PARAMS = 50_000_000


def model_config(model) -> dict:
    """The model's config as a dict: a checkpoint's config.json, the 1.5B shape, or an in-memory model's config."""
    source = resolve(model)
    if isinstance(source, str) and source == RANDOM_1P5B:
        return dict(QWEN25_1P5B)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{Path(source)} has no config.json: not a Hugging Face checkpoint directory")
        return json.loads(path.read_text())
    return source.config.to_dict()


def parameter_count(cfg: dict) -> int:
    """Parameters of a Qwen2 decoder with this config (biases and norms left out: they do not change its class)."""
    h, layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or h // heads
    attention = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim      # q, o; k, v
    embeddings = cfg["vocab_size"] * h * (1 if cfg.get("tie_word_embeddings", True) else 2)
    return embeddings + layers * (attention + 3 * h * inter)


def model_class(model) -> str:
    """"small" or "large", from the model's config (never its name or path): the gates serve a small model the
    CPU-scaled workloads and pages, a large one the gate workloads."""
    return "small" if parameter_count(model_config(model)) <= SMALL_MAX_PARAMS else "large"


def is_small(model) -> bool:
    return model_class(model) == "small"


def transformers_models():
    """transformers, told that Hugging Face's hub kernels are not there. From 5.25 it requires their `kernels`
    distribution and, finding it, imports `kernels` when it loads a model; in a stepgate process that name is this
    repository's kernels/ (the attention backends: the layout is fixed), so the import fails. stepgate never asks
    for hub kernels (its reference is transformers' eager attention), so the availability check answers False
    before any module of transformers that reads it is imported. Call it before importing a transformers model."""
    import sys

    import transformers.utils as utils
    from transformers.utils import import_utils
    if "transformers.integrations.hub_kernels" not in sys.modules:
        utils.is_kernels_available = import_utils.is_kernels_available = lambda *args, **kwargs: False
    return __import__("transformers")


def qwen2_config(**kw):
    Qwen2Config = transformers_models().Qwen2Config
    theta = kw.pop("rope_theta", 10000.0)
    cfg = Qwen2Config(**kw)
    # transformers 5 keeps theta in rope_parameters; 4.x in rope_theta. Set both.
    cfg.rope_theta = theta
    if getattr(cfg, "rope_parameters", None) is not None:
        cfg.rope_parameters = {**cfg.rope_parameters, "rope_theta": theta}
    return cfg


# The config.json fields engine/model.py's ModelShape reads (head_dim may be absent: hidden_size / heads), and the
# rotary base, in rope_theta or rope_parameters as transformers 4.x or 5 writes it.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")


def checkpoint_config(path: Path):
    """A checkpoint directory's config: its config.json as it stands where that is a Qwen2 config naming every field
    of the model's shape (as transformers' save_pretrained writes one: both embedded models' do), read without
    importing transformers, which cost a gate process about 8 s from a fresh start (session 41's profile of the
    GPU gate suite: a passing gate run needs transformers for nothing else); else transformers' AutoConfig, which
    fills what is missing with its defaults. tests/test_loader.py holds both to the same shape."""
    from types import SimpleNamespace
    raw = json.loads((path / "config.json").read_text())
    theta = raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta"))
    if raw.get("model_type") == "qwen2" and theta is not None and all(raw.get(f) is not None for f in SHAPE_FIELDS):
        return SimpleNamespace(**{**raw, "rope_theta": theta})
    return transformers_models().AutoConfig.from_pretrained(str(path))


def resolve(source) -> str | Path | object:
    if source is None:
        return SMALL_MODEL_DIR
    if isinstance(source, str) and source in NAMED_MODELS:
        return NAMED_MODELS[source]
    return source


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    single = path / "model.safetensors"
    if single.exists():
        return load_file(str(single))
    index = path / "model.safetensors.index.json"
    if not index.exists():
        raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    sd = {}
    for f in files:
        sd.update(load_file(str(path / f)))
    return sd


def random_1p5b_state(seed: int = 0, std: float = 0.02, embed_std: float = 0.2, device="cpu", dtype=torch.float16):
    """Qwen2.5-1.5B's shape, seeded random weights. The (tied) embedding is drawn 10x wider than the rest so that
    logits are decisive (std ~8, like the small model's) and greedy gates on this model are not all near ties."""
    cfg = qwen2_config(**QWEN25_1P5B)
    shape = ModelShape.of(cfg)
    with torch.device(device):
        m = Qwen2(shape).to(dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif "embed_tokens" in name:
                p.normal_(0.0, embed_std, generator=g)
            else:
                p.normal_(0.0, std, generator=g)
    return cfg, m


def load_model(source=None, dtype=torch.float32, device="cpu") -> tuple[Qwen2, object, str]:
    """Returns (our model on `device` in `dtype`, the transformers config, a name for the weights)."""
    source = resolve(source)
    if isinstance(source, str) and source == RANDOM_1P5B:
        cfg, m = random_1p5b_state(device=device, dtype=dtype)
        return m.eval().fuse(), cfg, RANDOM_1P5B
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_dir():
            named = next((k for k, d in NAMED_MODELS.items() if Path(d) == path), None)
            raise FileNotFoundError(
                f"model directory {path} does not exist" + (
                    f": the embedded model {named!r} ships with stepgate (golden/models in a checkout, the "
                    f"stepgate_models package once installed); reinstall stepgate (`pip install .`), or pass a "
                    f"Hugging Face checkpoint directory" if named else ""))
        cfg = checkpoint_config(path)
        sd = load_state_dict(path)
        name = path.name
    else:   # an in-memory transformers model
        cfg = source.config
        sd = source.state_dict()
        name = getattr(cfg, "name_or_path", "") or "in-memory"
    m = Qwen2(ModelShape.of(cfg))
    missing, unexpected = m.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and m.shape.tie_word_embeddings)]
    if missing:
        raise ValueError(f"checkpoint is missing weights: {missing[:5]}")
    return m.to(device=device, dtype=dtype).eval().fuse(), cfg, name


def hf_model(source=None, dtype=torch.float32, device="cpu"):
    """transformers' own Qwen2ForCausalLM on the same weights (eager attention: the ground truth)."""
    Qwen2ForCausalLM = transformers_models().Qwen2ForCausalLM
    source = resolve(source)
    if isinstance(source, str) and source == RANDOM_1P5B:
        cfg, ours = random_1p5b_state(device=device, dtype=dtype)
        with torch.device(device):
            m = Qwen2ForCausalLM._from_config(cfg, attn_implementation="eager", dtype=dtype)
        m.load_state_dict(ours.state_dict(), strict=False)
        m.tie_weights()
        return m.eval()
    if not isinstance(source, (str, os.PathLike)):
        return source
    # use_kernels=False: from 5.25 a model loads with hub kernels unless told not to; the reference is eager
    return Qwen2ForCausalLM.from_pretrained(str(source), dtype=dtype, attn_implementation="eager",
                                            use_kernels=False).to(device).eval()


def model_checksum(source=None) -> str:
    source = resolve(source)
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        h = hashlib.sha256()
        for f in sorted(Path(source).glob("*.safetensors")):
            h.update(f.read_bytes())
        return h.hexdigest()[:16]
    return str(source)
