"""The console commands name the extra they need when the install lacks it (gpufleet.launch)."""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError

import pytest

from gpufleet import launch


def test_the_extras_requirements_come_from_the_installed_metadata() -> None:
    assert "numpy" in launch.extra_requirements("detector")
    assert "nvidia-ml-py" in launch.extra_requirements("agent")
    sim = launch.extra_requirements("sim")  # gpufleet[agent,detector] followed
    assert {"nvidia-ml-py", "scikit-learn", "rich"} <= set(sim)
    assert launch.missing("all") == []  # this (dev) install has everything


def test_a_command_without_its_extra_names_it_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    # grafanalib uninstalled, as on a host without [dashboards]
    for name in [m for m in sys.modules if m.startswith(("gpufleet.dashboards", "grafanalib"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "grafanalib", None)
    from importlib.metadata import version as real

    def version(name: str) -> str:
        if name == "grafanalib":
            raise PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(launch, "version", version)
    monkeypatch.setattr(sys, "argv", ["gpufleet-dashboards", "--check"])
    assert launch.dashboards() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("gpufleet-dashboards: this install lacks the [dashboards] extra (grafanalib not installed")


def test_a_missing_module_that_no_extra_explains_is_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(launch.COMMANDS, "gpufleet-x", ("dashboards", "gpufleet.no_such_module:main"))
    with pytest.raises(ModuleNotFoundError):
        launch.launch("gpufleet-x")
