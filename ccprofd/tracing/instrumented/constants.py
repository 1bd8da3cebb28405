"""The constants instrumented.c and its Python side share, read from instrumented.c (the one
source; :mod:`ccprofd.kbpf.cdefs`)."""

from __future__ import annotations

from pathlib import Path

from ccprofd.kbpf.cdefs import c_constants

C_SOURCE = "instrumented.c"
_C = c_constants(Path(__file__).with_name(C_SOURCE))

NONE32 = 0xFFFFFFFF

# piece kinds
K_CALL, K_TAIL, K_EXIT, K_TAILEXIT, K_ROOT, K_SEG = (
    _C[n] for n in ("K_CALL", "K_TAIL", "K_EXIT", "K_TAILEXIT", "K_ROOT", "K_SEG"))
EXIT_KINDS = frozenset({K_EXIT, K_TAILEXIT})
# site flags
F_ACYC, F_CYCLIC, F_EXIT, F_SCOPE, F_OVERFLOW, F_CUT = (
    _C[n] for n in ("F_ACYC", "F_CYCLIC", "F_EXIT", "F_SCOPE", "F_OVERFLOW", "F_CUT"))
# per-thread state flags
ST_INCOMPLETE_BASE, ST_FROZEN, ST_FORK_PENDING, ST_BIAS, ST_READFAIL, ST_OVERFLOW = (
    _C[n] for n in ("ST_INCOMPLETE_BASE", "ST_FROZEN", "ST_FORK_PENDING", "ST_BIAS", "ST_READFAIL",
                    "ST_OVERFLOW"))
# sample flags
SF_NOSTATE, SF_FROZEN, SF_INCOMPLETE_BASE, SF_SEGS_TRUNC, SF_REC_TRUNC, SF_READFAIL, SF_BIAS, SF_OVERFLOW = (
    _C[n] for n in ("SF_NOSTATE", "SF_FROZEN", "SF_INCOMPLETE_BASE", "SF_SEGS_TRUNC", "SF_REC_TRUNC",
                    "SF_READFAIL", "SF_BIAS", "SF_OVERFLOW"))
INCOMPLETE_FLAGS = (SF_NOSTATE | SF_FROZEN | SF_INCOMPLETE_BASE | SF_SEGS_TRUNC | SF_REC_TRUNC | SF_READFAIL
                    | SF_OVERFLOW)
# return-site table flags above the call site id
RS_INDIRECT, RS_IN_SCOPE, RS_VIA_PLT, RS_INDEX = (
    _C[n] for n in ("RS_INDIRECT", "RS_IN_SCOPE", "RS_VIA_PLT", "RS_INDEX"))
# cc_config indexes
CFG_LAUNCH_TGID, CFG_LAUNCHED, CFG_AGGREGATE, CFG_EMIT_HITS, CFG_TEXT_LO, CFG_TEXT_HI = (
    _C[n] for n in ("CFG_LAUNCH_TGID", "CFG_LAUNCHED", "CFG_AGGREGATE", "CFG_EMIT_HITS", "CFG_TEXT_LO",
                    "CFG_TEXT_HI"))
# how a record's sample is counted
AGG_NONE, AGG_NEW, AGG_HIT, AGG_UNAGGREGATED = (
    _C[n] for n in ("AGG_NONE", "AGG_NEW", "AGG_HIT", "AGG_UNAGGREGATED"))
ARG_LEN = _C["CC_ARG_LEN"]
STACK_SWITCH_GAP = _C["STACK_SWITCH_GAP"]  # farther than any one stack reaches: another stack


#: Why a thread traced without per-thread state (loader.Limits.slots, CCPROFD_THREADS) is flagged.
NO_STATE = "no per-thread state: every state slot was in use (CCPROFD_THREADS)"
