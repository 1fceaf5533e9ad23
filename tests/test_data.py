"""Dataset checks (`grpokit.data.check_dataset`): the errors a user can fix before any model is loaded."""

import pytest
from datasets import Dataset

from grpokit.data import check_dataset


@pytest.mark.parametrize(
    "dataset",
    [Dataset.from_dict({"prompt": []}), Dataset.from_dict({}), []],
    ids=["no rows", "no columns", "empty list"],
)
@pytest.mark.parametrize("name", ["train_dataset", "eval_dataset"])
def test_empty_dataset_is_called_empty(dataset, name):
    with pytest.raises(ValueError, match=f"{name} is empty"):
        check_dataset(dataset, name)


def test_dataset_without_a_prompt_column_names_its_columns():
    with pytest.raises(ValueError, match=r"no 'prompt' column \(columns: \['answer', 'question'\]\)"):
        check_dataset(Dataset.from_dict({"question": ["1+1"], "answer": ["2"]}))
    check_dataset([{"prompt": "1+1"}])


@pytest.mark.parametrize("spec", ["trian.jsonl", "data/train.jsonl", "./nowhere", "missing.parquet"])
def test_a_missing_local_dataset_file_is_not_looked_up_on_the_hub(spec, tmp_path, monkeypatch):
    from grpokit.data import load_dataset_source

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text('{"prompt": "a"}\n')
    with pytest.raises(FileNotFoundError, match="not found: no such file or directory"):
        load_dataset_source(spec)


def test_a_mistyped_dataset_file_name_gets_a_suggestion(tmp_path, monkeypatch):
    from grpokit.data import load_dataset_source

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text('{"prompt": "a"}\n')
    with pytest.raises(FileNotFoundError, match=r"Did you mean train.jsonl"):
        load_dataset_source("trian.jsonl")
    assert load_dataset_source("train.jsonl")[0] == {"prompt": "a"}
