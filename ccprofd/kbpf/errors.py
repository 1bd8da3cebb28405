"""Domain errors of the BPF layer.

Every failure of loading, attaching or probing surfaces as a :class:`BPFError` whose ``str()`` is a
single line, so the CLI can print it as ``ccprofd: <message>`` and exit 1 without a traceback.
"""

from __future__ import annotations


class BPFError(Exception):
    """A BPF operation failed; the message is one line (newlines are folded)."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))

    @property
    def message(self) -> str:
        return str(self.args[0])


class MissingFeature(BPFError):
    """A kernel or system feature ccprofd needs is absent (probed for real at start)."""

    def __init__(self, feature: str, detail: str = "") -> None:
        self.feature = feature
        self.detail = detail
        text = f"ccprofd: missing kernel feature: {feature}"
        if detail:
            text += f" ({detail})"
        super().__init__(text)
