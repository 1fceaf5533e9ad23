"""Without openenv-core, grpokit imports as ever and OpenEnvEnvironment says how to install it (runs in every
environment: openenv is hidden here when it is installed)."""

import sys

import pytest


def test_a_missing_openenv_names_the_extra(monkeypatch):
    from grpokit.integrations.openenv import OpenEnvEnvironment

    monkeypatch.setitem(sys.modules, "openenv", None)  # `import openenv` raises ImportError
    monkeypatch.setitem(sys.modules, "openenv.core", None)
    with pytest.raises(ImportError, match=r'pip install "grpokit\[openenv\]"'):
        OpenEnvEnvironment("http://localhost:8000")
