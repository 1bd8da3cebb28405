# Benchmarks.  `make bench` regenerates the evaluation report (docs/results.md, docs/results-summary.md,
# docs/results.json, docs/report-*.png) on this machine; `make bench-ci` runs the reduced version into a
# temporary directory (what CI runs through tests/test_report_reduced.py).  Both need root (BPF).
PYTHON ?= .venv/bin/python
BENCH_OUT ?= docs

.PHONY: bench bench-setup bench-ci bench-daemon bench-unwind bench-trace bench-services bench-services-anomaly \
	bench-go-service bench-services-detect

bench-setup:
	bash bench/setup.sh

bench: bench-setup
	$(PYTHON) bench/report.py --out $(BENCH_OUT)
	$(PYTHON) bench/unwind.py --update-readme
	$(PYTHON) bench/daemon.py --update-readme
	$(PYTHON) bench/trace_throughput.py --update-readme

# Unwind mode's cost per sample against bpf_get_stack at 6..4,000 frames, and unwind-table build
# time; rewrites the README's bench:unwind section (~3 minutes).
bench-unwind: bench-setup
	$(PYTHON) bench/unwind.py --update-readme

# The daemon's cost at 10k syscalls/s (both modes, untraced and bcc syscount beside it), start-up
# and stop; rewrites the README's bench:daemon section (~10 minutes).
bench-daemon: bench-setup
	$(PYTHON) bench/daemon.py --update-readme

# ccprofd trace's decode-and-write throughput (repeated and distinct contexts) and end-to-end rate
# beside strace -k; rewrites the README's bench:trace_throughput section (~3 minutes).
bench-trace: bench-setup
	$(PYTHON) bench/trace_throughput.py --update-readme

# Real services under the daemon (issue 14: redis, nginx, postgres): throughput and latency untraced,
# under ccprofd run (unwind, all syscalls and a security set) and under perf record --call-graph
# dwarf, then ccprofd's frames checked against perf script's (redis, nginx, postgres); rewrites the README's
# bench:services section (~30 minutes with the default 5 rounds).
bench-services: bench-setup
	$(PYTHON) bench/services.py --update-readme

# Anomaly learning curves and injected attacks on the same services (issue 14): writes
# docs/services-anomaly.md and docs/services-anomaly-learning-curve.png.
bench-services-anomaly: bench-setup
	$(PYTHON) bench/services_anomaly.py --keep "$$(mktemp -d)"

# The daemon's anomaly detection on redis under redis-benchmark, with an attack injected under load.
bench-services-detect: bench-setup
	$(PYTHON) bench/services_detect.py --update-readme

# A Go service (Debian's prometheus) under ccprofd trace -p: complete chains, where the others stop,
# and anomaly alerts on a held-out window; rewrites the README's bench:go_service section (~3 minutes).
bench-go-service: bench-setup
	$(PYTHON) bench/go_service.py --update-readme

bench-ci:
	out=$$(mktemp -d /tmp/ccprofd-bench-ci-XXXXXX) && $(PYTHON) bench/report.py --reduced --out "$$out" && \
	  echo "reduced report in $$out"
