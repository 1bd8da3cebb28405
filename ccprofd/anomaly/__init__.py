"""Anomaly detection: the model of (syscall, calling context) pairs, detection, storage, enforcement."""
