"""The build steps in pipeline order: a new step is its module and one line in :data:`STEPS` (and its outputs'
dataclass in rig/record.py, which the build record is read back into)."""

from __future__ import annotations

from rig.steps.base import Step
from rig.steps.install import InstallStep
from rig.steps.ops import OpsStep
from rig.steps.pack import PackStep
from rig.steps.runtime import RuntimeStep
from rig.steps.toolchain import ToolchainStep
from rig.steps.tools import ToolsStep
from rig.steps.tree import TreeStep
from rig.steps.venv import VenvStep

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
