"""The build steps in pipeline order."""

from __future__ import annotations

from rig.build.install import InstallStep
from rig.build.ops import OpsStep
from rig.build.pipeline import (
    ORDER,  # noqa: F401 - re-exported for the CLI
    Step,
)
from rig.build.runtime import RuntimeStep
from rig.build.toolchain import ToolchainStep
from rig.build.tools import ToolsStep
from rig.build.tree import TreeStep
from rig.build.venv import VenvStep


def steps() -> list[Step]:
    """Every implemented step, in pipeline order."""
    return [ToolsStep(), TreeStep(), VenvStep(), RuntimeStep(), ToolchainStep(), OpsStep(), InstallStep()]
