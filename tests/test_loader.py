"""engine/loader.py's checkpoint config: a complete Qwen2 config.json is read without transformers, and gives the
shape transformers' AutoConfig gives; an incomplete one goes through AutoConfig (its defaults)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.loader import NAMED_MODELS, checkpoint_config, transformers_models
from engine.model import ModelShape

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(NAMED_MODELS))
def test_an_embedded_model_is_read_as_transformers_reads_it(name):
    path = Path(NAMED_MODELS[name])
    ours = checkpoint_config(path)
    assert type(ours).__module__ == "types", "a complete config.json must not go through transformers"
    theirs = transformers_models().AutoConfig.from_pretrained(str(path))
    assert ModelShape.of(ours) == ModelShape.of(theirs)


@pytest.mark.parametrize("drop", ["rms_norm_eps", "num_key_value_heads", "tie_word_embeddings", "rope"])
def test_a_config_missing_a_shape_field_takes_transformers_defaults(tmp_path, drop):
    raw = json.loads((Path(NAMED_MODELS["small"]) / "config.json").read_text())
    if drop == "rope":
        raw.pop("rope_theta")
        raw.pop("rope_parameters")
    else:
        raw.pop(drop)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = checkpoint_config(tmp_path)
    assert type(cfg).__module__ != "types"
    assert ModelShape.of(cfg) == ModelShape.of(transformers_models().AutoConfig.from_pretrained(str(tmp_path)))


def test_rope_theta_from_rope_parameters_alone(tmp_path):
    """transformers 5 may write the rotary base in rope_parameters only."""
    raw = json.loads((Path(NAMED_MODELS["small"]) / "config.json").read_text())
    raw.pop("rope_theta")
    raw["rope_parameters"] = {"rope_theta": 12345.0, "rope_type": "default"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert ModelShape.of(checkpoint_config(tmp_path)).rope_theta == 12345.0


def test_loading_the_small_model_imports_no_transformers():
    """A gate process that passes needs transformers for nothing (the hf reference is made at a failure's triage):
    loading the embedded model must not import it."""
    code = ("import sys; from engine.loader import load_model; load_model('small'); "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "load_model('small') imported transformers"
