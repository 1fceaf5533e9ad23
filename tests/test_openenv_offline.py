"""What grpokit.integrations.openenv does without openenv-core (runs in every environment; openenv is hidden where
it is installed): its action parsers and observation rendering, and the message that says how to install it."""

import sys

import pytest

from grpokit.integrations.openenv import OpenEnvEnvironment, json_action, render_observation, text_action


def test_a_missing_openenv_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv", None)  # `import openenv` raises ImportError
    monkeypatch.setitem(sys.modules, "openenv.core", None)
    with pytest.raises(ImportError, match=r'pip install "grpokit\[openenv\]"'):
        OpenEnvEnvironment("http://localhost:8000")


def test_the_default_parser_reads_the_last_json_object_and_refuses_the_rest():
    assert json_action('I will move.\n```json\n{"move": "up"}\n```') == {"move": "up"}
    assert json_action('first {"a": 1} then {"a": {"b": 2}}.') == {"a": {"b": 2}}
    with pytest.raises(ValueError):
        json_action("no action here")
    with pytest.raises(ValueError):
        json_action("{not json}")
    assert text_action("message")("  hello\n") == {"message": "hello"}


def test_observations_render_as_one_fields_text_or_json():
    assert render_observation({"feedback": "higher", "board": None}) == "higher"
    assert render_observation({"x": 1, "y": [2]}) == '{"x": 1, "y": [2]}'
    assert render_observation({"count": 3}) == "3"
    assert render_observation("plain") == "plain"
