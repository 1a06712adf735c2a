"""The build steps in pipeline order."""

from __future__ import annotations

from rig.steps.install import InstallStep
from rig.steps.ops import OpsStep
from rig.steps.pack import PackStep
from rig.steps.pipeline import ORDER, Step
from rig.steps.runtime import RuntimeStep
from rig.steps.toolchain import ToolchainStep
from rig.steps.tools import ToolsStep
from rig.steps.tree import TreeStep
from rig.steps.venv import VenvStep


def steps() -> list[Step]:
    """The eight steps, in pipeline order."""
    out = [ToolsStep(), TreeStep(), VenvStep(), RuntimeStep(), ToolchainStep(), OpsStep(), InstallStep(), PackStep()]
    assert [st.name for st in out] == list(ORDER)
    return out
