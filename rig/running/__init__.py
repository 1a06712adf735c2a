"""The running layer: one engine on this box: launch, health, the hang watchdog, the free-GPU gate, the log and its
reader."""
