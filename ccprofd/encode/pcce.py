"""PCCE (Sumner et al., ICSE 2010; Valence section 2.1): numCC, En(e), dummy root, back-edge stack.

Back edges are those a DFS finds from the virtual root, visiting out-edges in call-site address
order (then from every node the root does not reach, in node-id order).  The dummy root ``D`` has
one edge to the virtual root, one to every back-edge target, and -- an extension needed for
segments (entry from outside code may land anywhere) -- one to every other source of the graph
without back edges, so ``numCC(n) >= 1`` everywhere and a context can restart at any node.
Dummy edges are visited after a node's real incoming edges, so the real heaviest edge keeps
``En = 0``.

A back edge ``p -> t`` pushes ``(id, back-edge code)`` and sets ``id = En(D -> t)``; the plan
stores that value as the edge's ``code``.  Forward edges add ``En(e)`` before the call and subtract
it after.  The id is ``pcce_words`` words wide; wider requirements are reported as overflow.
"""

from __future__ import annotations

from collections.abc import Sequence

from ccprofd.encode.bits import ceil_log2, words_for_bits
from ccprofd.encode.edges import EdgeArrays
from ccprofd.encode.valence import SchemeTables

NO_DUMMY = -1


def back_edges(ea: EdgeArrays) -> tuple[bytearray, list[int]]:
    """DFS from the root in call-site order; returns (back-edge flags, reverse postorder)."""
    n = len(ea.nodes)
    color = bytearray(n)  # 0 white, 1 on stack, 2 done
    back = bytearray(ea.n_edges)
    post: list[int] = []
    callee = ea.callee
    outgoing = ea.outgoing
    starts = [ea.root] + [v for v in range(n) if v != ea.root]  # dense order == node-id order
    for s in starts:
        if color[s]:
            continue
        color[s] = 1
        stack: list[tuple[int, int]] = [(s, 0)]
        while stack:
            u, i = stack[-1]
            outs = outgoing[u]
            if i < len(outs):
                stack[-1] = (u, i + 1)
                e = outs[i]
                v = callee[e]
                c = color[v]
                if c == 0:
                    color[v] = 1
                    stack.append((v, 0))
                elif c == 1:
                    back[e] = 1
            else:
                color[u] = 2
                post.append(u)
                stack.pop()
    post.reverse()
    return back, post


def number_contexts(topo: Sequence[int], ins: Sequence[Sequence[int]], parent: Sequence[int],
                    dummy: bytearray, root: int,
                    n_edges: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """numCC and En over a DAG given in topological order.

    ``ins[x]`` are the real incoming edges of DAG node ``x`` in visiting order, ``parent[e]`` the DAG
    node an edge comes from, ``dummy[x]`` whether ``D -> x`` exists.  Returns ``(numcc, en,
    en_dummy, numcc_table1)`` where ``numcc_table1`` leaves the dummy edges out (the virtual root
    counts 1): the paper's Table 1 quantity.
    """
    nx_ = len(ins)
    numcc = [0] * nx_
    table1 = [0] * nx_
    en = [0] * n_edges
    en_dummy = [NO_DUMMY] * nx_
    for x in topo:
        total = 0
        t1 = 1 if x == root else 0
        for e in ins[x]:
            en[e] = total
            p = parent[e]
            total += numcc[p]
            t1 += table1[p]
        if dummy[x]:
            en_dummy[x] = total
            total += 1
        numcc[x] = total
        table1[x] = t1
    return numcc, en, en_dummy, table1


def id_width(numcc: Sequence[int]) -> tuple[int, int]:
    """(largest numCC, bits of the id): ids range over ``[0, numCC(n))``."""
    top = max(numcc) if numcc else 1
    return top, ceil_log2(top)


def table1_bits(table1: Sequence[int]) -> int:
    """Max ``ceil(log2 numCC(n))`` over nodes with at least one context (Table 1's column)."""
    best = 0
    for k in table1:
        if k > 0:
            best = max(best, ceil_log2(k))
    return best


def build_pcce(ea: EdgeArrays, pcce_words: int) -> SchemeTables:
    back, topo = back_edges(ea)
    n = len(ea.nodes)
    m = ea.n_edges
    fwd_in: list[list[int]] = [[e for e in lst if not back[e]] for lst in ea.incoming]
    dummy = bytearray(n)
    dummy[ea.root] = 1
    back_map: list[int] = []
    rec: list[int | None] = [None] * m
    for e in range(m):
        if back[e]:
            dummy[ea.callee[e]] = 1
            rec[e] = len(back_map)
            back_map.append(e)
    for x in range(n):
        if not fwd_in[x]:
            dummy[x] = 1
    numcc, en, en_dummy, table1 = number_contexts(topo, fwd_in, ea.caller, dummy, ea.root, m)
    max_numcc, bits = id_width(numcc)
    words_needed = max(1, words_for_bits(bits))
    lo: list[int | None] = [None] * m
    hi: list[int | None] = [None] * m
    code = [0] * m
    for e in range(m):
        if back[e]:
            code[e] = en_dummy[ea.callee[e]]  # id after the push
        else:
            code[e] = en[e]
            lo[e] = 0
            hi[e] = bits
    tables = {
        # per dense node: [[En, edge id], ...] ascending, dummy edge as edge id -1
        "incoming": [[[en[e], e] for e in fwd_in[x]] + ([[en_dummy[x], NO_DUMMY]] if dummy[x] else [])
                     for x in range(n)],
        "numcc": numcc,
        "back_map": back_map,
        "rec_code_bits": ceil_log2(len(back_map)) if back_map else 0,
    }
    stats = {
        "acyclic_bits": table1_bits(table1),
        "rec_code_bits": tables["rec_code_bits"],
        "max_numcc": max_numcc,
        "id_bits": bits,
        "words_needed": words_needed,
        "overflow": words_needed > pcce_words,
        "back_edges": len(back_map),
    }
    return SchemeTables(lo=lo, hi=hi, code=code, rec_code=rec, tables=tables, stats=stats)
