"""Segments: callbacks from code ccprofd did not analyse and edges the graph does not have."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_encode_graphs import EXTERNAL, addr, make_graph

from ccprofd.callgraph.model import ROOT, CallGraph
from ccprofd.decode import DecodeError, StaleAboveSegment, UnknownCaller, decoder_for
from ccprofd.encode import OUTSIDE, EncodedState, Encoder, Segment, build_plan

MAIN, F, CMP = addr(0), addr(1), addr(2)


def qsort_graph() -> CallGraph:
    # main -> F -> qsort@plt; cmp is address-taken (a root) and calls F.  The graph has no
    # qsort -> cmp edge, so the run-time cycle F -> qsort -> cmp -> F is unknown to it.
    return make_graph(3, [(0, 1), (1, EXTERNAL), (2, 1)], roots=(0, 2), with_external=True)


def qsort_run() -> tuple[list[tuple[int, int, int]], list[str]]:
    main_f = (MAIN, F, addr(0) + 1)
    f_qsort = (F, EXTERNAL, addr(1) + 2)
    cmp_f = (CMP, F, addr(2) + 3)
    path = [(ROOT, MAIN, 0), main_f, f_qsort, (EXTERNAL, CMP, OUTSIDE), cmp_f, f_qsort,
            (EXTERNAL, CMP, OUTSIDE), cmp_f]
    return path, ["call", "call", "call", "outside", "call", "call", "outside", "call"]


@pytest.mark.parametrize("scheme", ["valence", "pcce", "hcce"])
def test_callback_recursion_through_qsort(scheme: str) -> None:
    plan = build_plan(qsort_graph(), scheme)
    enc = Encoder(plan)
    path, ops = qsort_run()
    dec = decoder_for(plan)
    for i, (edge, op) in enumerate(zip(path, ops, strict=True)):
        if op == "call":
            enc.call(edge)
        else:
            enc.enter_from_outside(edge[1])
        assert dec.decode(enc.state(), edge[1]) == path[: i + 1]
    st = enc.state()
    assert len(st.segments) == 2
    assert [s.callee for s in st.segments] == [CMP, CMP] and [s.caller for s in st.segments] == [EXTERNAL] * 2
    if scheme == "valence":
        # F has two level-0 parents (main first, cmp second): 1-bit codes in [0, 1).  main->F is 0,
        # cmp->F is 1.  Saved at the first entry: 0; at the second: 1; live: 1.
        assert [s.saved for s in st.segments] == [(0,), (1,)] and st.acyc == (1,)
    for _ in path:
        enc.ret()
    assert enc.state() == Encoder(plan).state()


@pytest.mark.parametrize("scheme", ["valence", "hcce"])
def test_recid_is_not_popped_below_a_segment(scheme: str) -> None:
    # f1 -> f2 -> f1 is a known cycle; f2 makes an indirect call to f1 (unknown edge).  Below the
    # segment recID holds f2->f1's code, whose edge ends at f1, the node where the segment starts.
    g = make_graph(3, [(0, 1), (1, 2), (2, 1)], roots=(0,))
    plan = build_plan(g, scheme)
    enc = Encoder(plan)
    f1, f2 = addr(1), addr(2)
    path = [(ROOT, addr(0), 0), (addr(0), f1, addr(0) + 1), (f1, f2, addr(1) + 2), (f2, f1, addr(2) + 3)]
    for e in path:
        enc.call(e)
    enc.unencoded_call(addr(1) + 0xF00, f1)  # f1 calls f1 indirectly: a self-cycle the graph lacks
    path.append((f1, f1, addr(1) + 0xF00))
    st = enc.state()
    assert st.rec_len > 0 and st.segments[0].rec_height == st.rec_len
    assert decoder_for(plan).decode(st, f1) == path


def test_segment_without_caller_is_flagged_or_resolved_from_the_site() -> None:
    g = make_graph(3, [(0, 1), (1, 2), (0, 2)], roots=(0,))
    plan = build_plan(g, "valence")
    dec = decoder_for(plan)
    # saved state: main -> f1 (path context at f1); entry into f2 from outside with unknown caller
    inner = Segment(saved=(0,), rec_height=0, site=OUTSIDE, callee=addr(2), caller=None)
    with pytest.raises(UnknownCaller) as exc:
        dec.decode(EncodedState(acyc=(0,), segments=(inner,)), addr(2))
    assert exc.value.partial == []  # nothing decoded above the segment's start
    # the same entry, but made by f1's call site at addr(1)+2 (an edge site): the caller is known
    known = Segment(saved=(0,), rec_height=0, site=addr(1) + 2, callee=addr(2), caller=None)
    path = dec.decode(EncodedState(acyc=(0,), segments=(known,)), addr(2))
    assert path == [(ROOT, addr(0), 0), (addr(0), addr(1), addr(0) + 1), (addr(1), addr(2), addr(1) + 2)]


def test_garbage_segment_state_is_flagged() -> None:
    g = make_graph(2, [(0, 1), (1, 1)], roots=(0,))
    plan = build_plan(g, "valence")
    seg = Segment(saved=(0,), rec_height=5, site=OUTSIDE, callee=addr(1), caller=addr(0))
    with pytest.raises(DecodeError):  # recID below the segment is shorter than its recorded height
        decoder_for(plan).decode(EncodedState(acyc=(0,), rec=0, rec_len=0, segments=(seg,)), addr(1))


@pytest.mark.parametrize("scheme", ["valence", "pcce", "hcce"])
def test_invalid_state_above_a_segment_leaves_the_path_inside_it(scheme: str) -> None:
    """Instrumented mode can save a dead call's bits as a segment's caller state (a piece kept after
    its frame returned): not a valid state for that node.  The decoder then gives the path inside
    the innermost segment -- decoded from what was set after it started -- as StaleAboveSegment's
    partial path (reported flagged), not nothing; a valid state still decodes whole."""
    plan = build_plan(qsort_graph(), scheme)
    enc = Encoder(plan)
    path, ops = qsort_run()
    for edge, op in zip(path[:5], ops[:5], strict=True):  # main -> F -> qsort -> (outside) cmp -> F
        if op == "call":
            enc.call(edge)
        else:
            enc.enter_from_outside(edge[1])
    st = enc.state()
    (seg,) = st.segments
    dec = decoder_for(plan)
    assert dec.decode(st, F) == path[:5]
    stale = replace(st, segments=(replace(seg, saved=(1 << 40,)),))  # above every level / id range here
    with pytest.raises(StaleAboveSegment) as exc:
        dec.decode(stale, F)
    assert exc.value.partial == [path[4]]  # cmp -> F: inside the segment
