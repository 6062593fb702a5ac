"""scripts/make_default_model.py installs a drafter only from a checkpoint, never from an empty directory."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def make_default_model():
    spec = importlib.util.spec_from_file_location("make_default_model", ROOT / "scripts/make_default_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(module, monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", ["make_default_model.py", *argv])
    module.main()


def test_an_existing_target_gets_the_drafter_from_a_checkpoint_and_not_from_an_empty_directory(make_default_model,
                                                                                               monkeypatch, tmp_path):
    out = tmp_path / "models"
    (out / make_default_model.TARGET_DIR).mkdir(parents=True)
    (out / make_default_model.TARGET_DIR / "config.json").write_text("{}")   # the target is there: no conversion
    drafter = out / make_default_model.DRAFTER_DIR
    empty = tmp_path / "empty" / make_default_model.DRAFTER_DIR
    empty.mkdir(parents=True)   # what the device's copy of a tree without drafters/ held
    run(make_default_model, monkeypatch, "--out", str(out), "--drafter-from", str(empty))
    assert not drafter.exists()   # an empty directory installed as the drafter: the engine found no config.json
    checkpoint = tmp_path / "checkpoint" / make_default_model.DRAFTER_DIR
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    run(make_default_model, monkeypatch, "--out", str(out), "--drafter-from", str(checkpoint))
    assert sorted(p.name for p in drafter.iterdir()) == ["config.json", "model.safetensors"]
