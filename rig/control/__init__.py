"""The control layer: what a command does with the layers below: start (gate, launch, nodes), status and stop, the
service, the bench."""
