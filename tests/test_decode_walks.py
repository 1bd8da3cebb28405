"""Property tests: random executions on random call graphs decode exactly at every step.

Each execution is a random walk of calls along graph edges, returns, entries from outside code,
calls along edges the graph does not have (which may close cycles the graph does not know) and
multi-frame unwinds (longjmp / exceptions).  The test keeps its own list of the true call path and
compares every scheme's decoding with it after every step.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_encode_graphs import addr, call_graphs, edge_list, weight_maps

from ccprofd.callgraph.model import ROOT, CallGraph
from ccprofd.decode import CachingDecoder, DecodeError, StackTagDecoder, decoder_for
from ccprofd.encode import OUTSIDE, Edge, EncodedState, Encoder, build_plan
from ccprofd.encode.bits import words_to_int

EXACT = ("valence", "pcce", "hcce")
MAX_DEPTH = 24
TAG_DEPTH = 5  # stack-tag search is exponential in depth; check it on shallow contexts


def run_walk(g: CallGraph, rnd: random.Random, steps: int, *, segments: bool, unwinds: bool,
             weights: dict[tuple[int, int, int], int] | None = None) -> int:
    plans = {s: build_plan(g, s, weights=weights) for s in (*EXACT, "stacktags")}
    encs = {s: Encoder(p) for s, p in plans.items()}
    decs = {s: decoder_for(plans[s]) for s in EXACT}
    cached = {s: CachingDecoder(decs[s]) for s in EXACT}
    tags = StackTagDecoder(plans["stacktags"])
    out: dict[int, list[Edge]] = {}
    for u, v, k in edge_list(g):
        out.setdefault(u, []).append((u, v, k))
    funcs = sorted(g.graph.nodes - {ROOT})
    truth: list[Edge] = []
    extra: set[tuple[int, int]] = set()
    checks = 0

    def apply(op: str, *args: Any) -> None:
        for enc in encs.values():
            getattr(enc, op)(*args)

    for _ in range(steps):
        cur = truth[-1][1] if truth else ROOT
        r = rnd.random()
        deep = len(truth) >= MAX_DEPTH
        if r < 0.5 and out.get(cur) and not deep:
            e = rnd.choice(out[cur])
            apply("call", e)
            truth.append(e)
        elif r < 0.72 and truth:
            apply("ret")
            truth.pop()
        elif r < 0.8 and segments and not deep:
            callee = rnd.choice(funcs)
            apply("enter_from_outside", callee)
            truth.append((cur, callee, OUTSIDE))
            extra.add((cur, callee))
        elif r < 0.88 and segments and not deep:
            callee = rnd.choice(funcs)
            site = (addr(0) if cur == ROOT else max(cur, 0)) + 0xF00
            apply("unencoded_call", site, callee)
            truth.append((cur, callee, site))
            extra.add((cur, callee))
        elif unwinds and truth:
            k = rnd.randint(1, len(truth))
            apply("unwind", k)
            del truth[-k:]
        else:
            continue
        cur = truth[-1][1] if truth else ROOT
        for s in EXACT:
            state = encs[s].state()
            assert decs[s].decode(state, cur) == truth, (s, truth, state)
            assert cached[s].decode(state, cur) == truth
            checks += 1
        acyc = encs["valence"].state().acyc
        assert words_to_int(acyc).bit_length() <= plans["valence"]["report"]["acyclic_bits"]
        if len(truth) <= TAG_DEPTH:
            res = tags.candidates(encs["stacktags"].state().tag, cur, max_depth=len(truth), extra_edges=extra)
            assert res.complete
            assert tuple(e[1] for e in truth) in res.candidates
    # unwinding everything returns to the empty state in every scheme
    if truth:
        apply("unwind", len(truth))
    for s in EXACT:
        assert decs[s].decode(encs[s].state(), ROOT) == []
        assert encs[s].state() == Encoder(plans[s]).state()
    return checks


@pytest.mark.parametrize("shape", ["dag", "any", "cycles"])
@settings(max_examples=40, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_walks_on_graph_edges_decode_exactly(shape: str, data: st.DataObject, seed: int) -> None:
    g = data.draw(call_graphs(shape))
    run_walk(g, random.Random(seed), 80, segments=False, unwinds=False)


@pytest.mark.parametrize("shape", ["dag", "any", "cycles"])
@settings(max_examples=40, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_walks_with_segments_and_unwinds_decode_exactly(shape: str, data: st.DataObject, seed: int) -> None:
    g = data.draw(call_graphs(shape))
    run_walk(g, random.Random(seed), 80, segments=True, unwinds=True)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_walks_with_weights_decode_exactly(data: st.DataObject, seed: int) -> None:
    g = data.draw(call_graphs("cycles"))
    w = data.draw(weight_maps(g))
    run_walk(g, random.Random(seed), 60, segments=True, unwinds=True, weights=w)


def test_walk_driver_really_checks() -> None:
    """The driver must exercise decoding (guards against a walk that never calls anything)."""
    from test_encode_graphs import make_graph

    g = make_graph(4, [(0, 1), (1, 2), (2, 1), (2, 3), (1, 3), (1, 3), (3, 3)])
    assert run_walk(g, random.Random(7), 300, segments=True, unwinds=True) > 200


# --------------------------------------------------------------------------- invalid states
def _reencode(plan: dict[str, Any], path: list[Edge]) -> EncodedState:
    enc = Encoder(plan)
    for e in path:
        enc.call(e)
    return enc.state()


@pytest.mark.parametrize("scheme", EXACT)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_arbitrary_states_decode_exactly_or_are_flagged(scheme: str, data: st.DataObject) -> None:
    """Exact or flagged, never wrong: a state either raises DecodeError or decodes to a path whose
    encoding is that very state."""
    g = data.draw(call_graphs("cycles", max_nodes=5))
    plan = build_plan(g, scheme)
    node = data.draw(st.sampled_from(sorted(g.graph.nodes)))
    width = max(plan["acyc_bits"], 1)
    acyc_val = data.draw(st.integers(0, (1 << width) - 1))
    acyc = tuple((acyc_val >> (64 * i)) & (2**64 - 1) for i in range(plan["acyc_words"]))
    rec_bits = plan["rec_code_bits"]
    n_codes = data.draw(st.integers(0, 4))
    pairs: tuple[tuple[tuple[int, ...], int], ...] = ()
    rec = rec_len = 0
    if scheme == "pcce":
        pairs = tuple(((data.draw(st.integers(0, (1 << width) - 1)),), data.draw(st.integers(0, 3)))
                      for _ in range(n_codes))
    elif rec_bits:
        rec_len = n_codes * rec_bits
        rec = data.draw(st.integers(0, (1 << rec_len) - 1)) if rec_len else 0
    state = EncodedState(acyc=acyc, rec=rec, rec_len=rec_len, pairs=pairs)
    try:
        path = decoder_for(plan).decode(state, node)
    except DecodeError:
        return
    assert (path[-1][1] if path else ROOT) == node
    assert _reencode(plan, path) == state
