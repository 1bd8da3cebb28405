"""Start-up feature probes: all present on a prepared machine, and failures read as one line that
names the missing feature."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import skip_or_fail

from ccprofd.kbpf import features, rawbpf, uprobe_multi
from ccprofd.kbpf.errors import BPFError, MissingFeature

ONE_LINE_PREFIX = "ccprofd: missing kernel feature: "


def test_all_features_present(bpf: None) -> None:
    results = features.probe_features()
    assert [r.name for r in results] == list(features.PROBES)
    missing = [str(r.error) for r in results if not r.ok]
    assert missing == []
    features.check_features(set(features.ALL_FEATURES))


def test_error_text_format() -> None:
    err = MissingFeature("uprobe_multi links", "needs Linux >= 6.6")
    assert str(err) == "ccprofd: missing kernel feature: uprobe_multi links (needs Linux >= 6.6)"
    assert isinstance(err, BPFError)
    assert str(BPFError("two\nlines  here")) == "two lines here"


def test_unknown_feature_name_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="no_such"):
        features.check_features({"no_such"})


def test_kernel_refusal_is_reported_as_missing_uprobe_multi(
    bpf: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Make the link's attach type disagree with the program's (what a pre-6.6 kernel does with 48):
    # the kernel refuses, and the probe must name the feature, on one line.
    monkeypatch.setattr(uprobe_multi, "BPF_TRACE_UPROBE_MULTI", 42)
    with pytest.raises(MissingFeature) as ei:
        features.check_features({"uprobe_multi"})
    text = str(ei.value)
    assert text.startswith(ONE_LINE_PREFIX + "uprobe_multi links (needs Linux >= 6.6")
    assert "\n" not in text


def test_unknown_helper_is_reported_as_missing_bpf_loop(bpf: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rawbpf, "BPF_FUNC_LOOP", 100_000)  # a helper id no kernel has
    with pytest.raises(MissingFeature) as ei:
        features.check_features({"bpf_loop", "ringbuf"})
    assert str(ei.value).startswith(ONE_LINE_PREFIX + "bpf_loop helper (needs Linux >= 5.17")
    assert "\n" not in str(ei.value)


def test_unprivileged_process_gets_one_line_and_exit_1(bpf: None) -> None:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        skip_or_fail("setpriv (util-linux) not installed")
    assert setpriv is not None
    code = (
        "import sys\n"
        "from ccprofd.kbpf.errors import BPFError\n"
        "from ccprofd.kbpf.features import check_features\n"
        "try:\n"
        "    check_features({'uprobe_multi', 'ringbuf'})\n"
        "except BPFError as e:\n"
        "    print(e, file=sys.stderr); sys.exit(1)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run(
        [
            setpriv,
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            sys.executable,
            "-c",
            code,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == ONE_LINE_PREFIX + "BPF privileges (run as root or with CAP_BPF and CAP_PERFMON)\n"


def test_probes_leave_nothing_behind(bpf: None) -> None:
    def fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    before = fds()
    features.probe_features()
    assert fds() <= before
