"""The built-in demo: `grpokit train` with no arguments."""

from .task import DemoTask, run_demo

__all__ = ["DemoTask", "run_demo"]
