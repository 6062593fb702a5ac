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
    with pytest.raises(SystemExit, match="no config.json"):
        run(make_default_model, monkeypatch, "--out", str(out), "--drafter-from", str(empty))
    assert not drafter.exists()   # an empty directory installed as the drafter: the engine found no config.json
    checkpoint = tmp_path / "checkpoint" / make_default_model.DRAFTER_DIR
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    run(make_default_model, monkeypatch, "--out", str(out), "--drafter-from", str(checkpoint))
    assert sorted(p.name for p in drafter.iterdir()) == ["config.json", "model.safetensors"]


def test_a_remade_target_takes_the_checkpoint_and_a_directory_without_one_stops_before_any_conversion(
        make_default_model, monkeypatch, tmp_path):
    converted = []

    def convert_target(gguf, target):   # the GGUF conversion itself is tested with the real file elsewhere
        converted.append(target)
        target.mkdir(parents=True, exist_ok=True)
        return {"mask_token_id": 16}

    monkeypatch.setattr(make_default_model, "convert_target", convert_target)
    gguf = tmp_path / make_default_model.GGUF_NAME
    gguf.write_bytes(b"gguf")
    out, empty = tmp_path / "models", tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match="no config.json"):   # not a random drafter in its place
        run(make_default_model, monkeypatch, "--out", str(out), "--gguf", str(gguf), "--force", "--drafter-from", str(empty))
    assert converted == [] and not out.exists()
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    run(make_default_model, monkeypatch, "--out", str(out), "--gguf", str(gguf), "--force", "--drafter-from",
        str(checkpoint))
    assert converted == [out / make_default_model.TARGET_DIR]
    assert [p.name for p in (out / make_default_model.DRAFTER_DIR).iterdir()] == ["config.json"]
