"""The serve plan layer: pure functions from settings, profile and box to the engine's command line and environment;
``./start.sh --dry-run`` prints the plan and nothing here starts a process."""
