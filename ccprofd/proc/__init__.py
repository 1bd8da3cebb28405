"""Running processes: /proc maps and modules, the vDSO, ptrace snapshots and user-stack walks."""
