"""A missing model path is one line; one that reads as a Hugging Face Hub id (`owner/name`) also
says that nothing is downloaded here and what to pass instead."""

from __future__ import annotations

import pytest

from specdec.models.loader import load_model, missing_model_message, read_model_config

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
NOT_DOWNLOADED = "(models are not downloaded here: pass a local HF directory or a GGUF file)"


@pytest.fixture(autouse=True)
def empty_cwd(tmp_path, monkeypatch):
    """Relative paths resolve in an empty directory, so none of them exists."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_hub_id_is_told_models_are_not_downloaded():
    expected = f"no such model path: {HUB_ID} {NOT_DOWNLOADED}"
    assert missing_model_message(HUB_ID) == expected
    with pytest.raises(FileNotFoundError) as loading:
        load_model(HUB_ID)
    with pytest.raises(FileNotFoundError) as reading:
        read_model_config(HUB_ID)
    assert str(loading.value) == str(reading.value) == expected


@pytest.mark.parametrize(
    "path", ["/abs/model", "models/llama/8b", "model.gguf", "./model", "../model", "owner/"]
)
def test_other_missing_paths_are_not_called_hub_ids(path):
    assert missing_model_message(path) == f"no such model path: {path}"


def test_an_existing_owner_name_directory_is_not_a_hub_id(empty_cwd):
    (empty_cwd / "owner" / "name").mkdir(parents=True)
    assert missing_model_message("owner/name") == "no such model path: owner/name"
