#!/usr/bin/env bash
# Run the rig under systemd: install | start | stop | status | update | rollback | logs | uninstall [--root DIR].
exec "$(dirname "${BASH_SOURCE[0]}")/nox.sh" -s service -- "$@"
