"""Dataset checks (`grpokit.data.check_dataset`): the errors a user can fix before any model is loaded."""

import pytest
from datasets import Dataset

from grpokit.data import check_dataset


@pytest.mark.parametrize("dataset", [Dataset.from_dict({"prompt": []}), Dataset.from_dict({}), []],
                         ids=["no rows", "no columns", "empty list"])  # fmt: skip
@pytest.mark.parametrize("name", ["train_dataset", "eval_dataset"])
def test_empty_dataset_is_called_empty(dataset, name):
    with pytest.raises(ValueError, match=f"{name} is empty"):
        check_dataset(dataset, name)


def test_dataset_without_a_prompt_column_names_its_columns():
    with pytest.raises(ValueError, match=r"no 'prompt' column \(columns: \['answer', 'question'\]\)"):
        check_dataset(Dataset.from_dict({"question": ["1+1"], "answer": ["2"]}))
    check_dataset([{"prompt": "1+1"}])
