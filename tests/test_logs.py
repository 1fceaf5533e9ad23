"""Trackers (`grpokit.logs`): what MetricSink logs reaches MLflow and Trackio stores, read back with their own
clients. Each test skips when its tracker is not installed (`pip install 'grpokit[trackers]'`, or the extra of the folder grpokit was installed from)."""

import re
import sys

import pytest
from letters import LETTERS, letter_config, letter_dataset, repeat_letter

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.logs import MetricSink
from grpokit.testing import save_tiny_model

RECORDS = [
    {"step": 1, "loss": 0.5, "reward": 0.25, "completions/mean_length": 3.0},
    {"step": 2, "loss": 0.25, "reward": 0.75, "completions/mean_length": 2.5},
    {"step": 2, "eval/reward": 0.5},
]
SAMPLES = [{"prompt": "a:", "completion": "a|b\nc", "reward": 1.0, "advantage": 0.5}]


def write_run(output_dir, report_to, config: GRPOConfig, run_name="run-1"):
    sink = MetricSink(str(output_dir), report_to, run_name, None, config.to_dict())
    for record in RECORDS:
        sink.write(record, console=False)
    sink.write_completions(2, SAMPLES)
    sink.close()


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 keeps the file store behind this switch
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "grpokit-test")
    mlflow.set_experiment("grpokit-test")  # mlflow remembers the active experiment across tests: this test's store
    return mlflow


def mlflow_run(mlflow):
    client = mlflow.tracking.MlflowClient()
    experiment = client.get_experiment_by_name("grpokit-test")
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


def test_mlflow_file_store_receives_metrics_params_and_completions(tmp_path, mlflow_store):
    config = GRPOConfig(output_dir=str(tmp_path / "out"), learning_rate=3e-4, report_to="mlflow")
    write_run(tmp_path / "out", config.report_to, config)
    client, run = mlflow_run(mlflow_store)
    assert run.info.run_name == "run-1" and run.info.status == "FINISHED"
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        for key in ("train/reward", "train/loss", "eval/reward")
    }
    assert history == {
        "train/reward": [(1, 0.25), (2, 0.75)],
        "train/loss": [(1, 0.5), (2, 0.25)],
        "eval/reward": [(2, 0.5)],
    }
    assert run.data.params["learning_rate"] == "0.0003" and run.data.params["report_to"] == "['mlflow']"
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "completions")]
    assert artifacts == ["completions/step_2.json"]


def test_mlflow_run_started_by_the_caller_stays_open(tmp_path, mlflow_store):
    config = GRPOConfig(output_dir=str(tmp_path / "out"))
    with mlflow_store.start_run(run_name="outer") as outer:
        write_run(tmp_path / "out", ["mlflow"], config)
        assert mlflow_store.active_run().info.run_id == outer.info.run_id
    _, run = mlflow_run(mlflow_store)
    assert run.info.run_name == "outer" and run.data.metrics["train/reward"] == 0.75


def test_trainer_reports_to_mlflow(tmp_path, mlflow_store):
    model_dir = str(save_tiny_model(tmp_path / "tiny", chars=LETTERS + ":", hidden_size=32))
    args = letter_config(tmp_path, max_steps=2, report_to="mlflow")
    trainer = GRPOTrainer(model=model_dir, reward_funcs=repeat_letter, args=args, train_dataset=letter_dataset())
    trainer.train()
    client, run = mlflow_run(mlflow_store)
    logged = [m.value for m in client.get_metric_history(run.info.run_id, "train/reward")]
    assert logged == pytest.approx([entry["reward"] for entry in trainer.state.log_history[:-1]])
    assert run.info.run_name == "out"  # the output directory's name, as for the other trackers


def test_trackio_local_store_receives_metrics(tmp_path, monkeypatch):
    if "trackio" in sys.modules:
        pytest.skip("trackio was imported before TRACKIO_DIR could point it at a temporary directory")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    trackio = pytest.importorskip("trackio")
    from trackio.sqlite_storage import SQLiteStorage

    config = GRPOConfig(output_dir=str(tmp_path / "out"), project="grpokit-test", report_to="trackio")
    write_run(tmp_path / "out", config.report_to, config)
    assert tmp_path / "trackio" == trackio.utils.TRACKIO_DIR
    logs = SQLiteStorage.get_logs("grpokit-test", "run-1")
    rewards = [(log["step"], log["train/reward"]) for log in logs if "train/reward" in log]
    assert rewards == [(1, 0.25), (2, 0.75)]
    assert [log["eval/reward"] for log in logs if "eval/reward" in log] == [0.5]


@pytest.mark.parametrize("name", ["mlflow", "trackio", "wandb"])
def test_missing_tracker_package_says_what_to_install(tmp_path, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # makes `import name` fail
    from grpokit.extras import install_command

    command = install_command("trackers", {"mlflow": "mlflow-skinny"}.get(name, name))
    with pytest.raises(ImportError, match=re.escape(f"report_to='{name}' needs {name}: {command}")):
        MetricSink(str(tmp_path), [name], None, None, {})


class RecordingTracker:
    """Stands in for a tracker service: keeps the tables it is sent."""

    def __init__(self):
        self.tables = []

    def log(self, metrics, step):
        pass

    def log_table(self, name, columns, rows, step):
        self.tables.append((name, columns, rows, step))

    def close(self):
        pass


@pytest.mark.parametrize("unique", [False, True])
def test_log_unique_prompts_keeps_the_first_row_of_each_prompt_in_the_trackers_table(tmp_path, unique):
    samples = [
        {"prompt": p, "completion": c, "reward": r, "advantage": 0.0}
        for p, c, r in [
            ("a:", "a", 1.0),
            ("b:", "x", 0.0),
            ("a:", "b", 0.0),
            ("b:", "b", 1.0),
            ([{"role": "user", "content": "c"}], "c", 1.0),
            ([{"role": "user", "content": "c"}], "d", 0.0),
        ]
    ]
    sink = MetricSink(str(tmp_path / "out"), [], "run", None, {})
    sink.trackers.append(tracker := RecordingTracker())
    sink.write_completions(3, samples, unique_prompts=unique)
    ((_name, _columns, rows, _step),) = tracker.tables
    completions = [row[1] for row in rows]
    assert completions == (["a", "x", "c"] if unique else ["a", "x", "b", "b", "c", "d"])
    assert len((tmp_path / "out" / "completions.jsonl").read_text().splitlines()) == 6  # the file keeps all


def test_trainer_passes_log_unique_prompts_to_the_trackers_table(tmp_path, monkeypatch):
    model_dir = str(save_tiny_model(tmp_path / "tiny", chars=LETTERS + ":", hidden_size=32))
    args = letter_config(tmp_path, max_steps=1, log_completions=True, log_unique_prompts=True)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=repeat_letter, args=args, train_dataset=letter_dataset())
    sent, write = [], MetricSink.write_completions
    monkeypatch.setattr(
        MetricSink,
        "write_completions",
        lambda self, step, samples, unique=False: sent.append(unique) or write(self, step, samples, unique),
    )
    trainer.train()
    assert sent == [True]


def test_the_console_shows_chat_prompts_as_text():
    """A conversational prompt on the console is its last message as text (with [image] for image parts), not JSON
    cut before the question."""
    from grpokit.logs import _short

    prompt = [
        {"role": "system", "content": "You are a careful assistant who answers in one word."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is the image?"}]},
    ]
    assert _short(prompt) == "user: [image] what colour is the image?"
    assert _short([{"role": "assistant", "content": "red"}]) == "assistant: red"
    assert _short(prompt, 200) == (
        "system: You are a careful assistant who answers in one word. | user: [image] what colour is the image?"
    )
    assert _short("x" * 80) == "x" * 57 + "..."
