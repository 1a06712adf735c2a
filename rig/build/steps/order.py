"""The build steps in pipeline order: a new step is its module and one line in :data:`STEPS` (and its outputs'
dataclass in rig/facts/record.py, which the build record is read back into)."""

from __future__ import annotations

from rig.build.steps.base import Step
from rig.build.steps.install import InstallStep
from rig.build.steps.ops import OpsStep
from rig.build.steps.pack import PackStep
from rig.build.steps.runtime import RuntimeStep
from rig.build.steps.toolchain import ToolchainStep
from rig.build.steps.tools import ToolsStep
from rig.build.steps.tree import TreeStep
from rig.build.steps.venv import VenvStep

STEPS: tuple[type[Step], ...] = (
    ToolsStep,
    TreeStep,
    VenvStep,
    RuntimeStep,
    ToolchainStep,
    OpsStep,
    InstallStep,
    PackStep,
)
ORDER = tuple(cls.name for cls in STEPS)


def steps() -> list[Step]:
    """The steps, in pipeline order."""
    return [cls() for cls in STEPS]
