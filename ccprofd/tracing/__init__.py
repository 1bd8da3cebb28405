"""The tracing engine behind ``ccprofd trace``, learn, detect and the daemon: two modes, one API."""
