"""The build steps in pipeline order."""

from __future__ import annotations

from rig.build.install import InstallStep
from rig.build.ops import OpsStep
from rig.build.pack import PackStep
from rig.build.pipeline import ORDER, Step
from rig.build.runtime import RuntimeStep
from rig.build.toolchain import ToolchainStep
from rig.build.tools import ToolsStep
from rig.build.tree import TreeStep
from rig.build.venv import VenvStep


def steps() -> list[Step]:
    """The eight steps, in pipeline order."""
    out = [ToolsStep(), TreeStep(), VenvStep(), RuntimeStep(), ToolchainStep(), OpsStep(), InstallStep(), PackStep()]
    assert [st.name for st in out] == list(ORDER)
    return out
