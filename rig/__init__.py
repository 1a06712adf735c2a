"""The vLLM serving rig: build a patched vLLM reproducibly and serve it on one box."""

import logging
from pathlib import Path

#: The repository root: every relative path of the rig is taken from here.
REPO_ROOT = Path(__file__).resolve().parent.parent

# nox turns on DEBUG logging for the whole process; the libraries the rig uses
# would then echo every git command and HTTP request.
for _name in ("git", "urllib3"):
    logging.getLogger(_name).setLevel(logging.WARNING)
