"""Hand-written call graphs of the test programs, read off their C sources.

Each source file carries the same table in its header comment.  For every program: its own functions,
the edges leaving them as (caller, callee, number of call sites, kind) at -O0 and at -O2, the
functions whose address is taken, the number of indirect *call* sites per function, and the cyclic
strongly connected components.  Callee names of external functions are the bare imported names.
Nothing here was copied from ccprofd's output; ``tests/test_oracle_binutils.py`` checks each table
against objdump (so a compiler that changes a shape is caught there, apart from analysis bugs).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

Edge = tuple[str, str, int, str]  # caller, callee, sites, kind ("direct" | "plt" | "tail")


def _edges(text: str) -> frozenset[Edge]:
    out = []
    for line in text.strip().splitlines():
        caller, arrow, callee, n, kind = line.split()
        assert arrow == "->", line
        out.append((caller, callee, int(n), kind))
    summary = Counter((c, d, k) for c, d, _, k in out)
    assert all(v == 1 for v in summary.values()), f"duplicate edge line in {text!r}"
    return frozenset(out)


@dataclass(frozen=True)
class Expected:
    functions: frozenset[str]  # the program's own functions (callers of the edges below, and leaves)
    edges_o0: frozenset[Edge]
    edges_o2: frozenset[Edge]
    address_taken: frozenset[str]  # own functions whose address is taken (main included)
    indirect_calls: dict[str, int]  # own function -> number of indirect call sites (absent = 0)
    cycles: frozenset[frozenset[str]]  # cyclic SCCs among own functions

    def edges(self, opt: str) -> frozenset[Edge]:
        return self.edges_o0 if opt == "O0" else self.edges_o2

    @property
    def roots(self) -> frozenset[str]:
        """Own functions the virtual root must connect to: main and the address-taken ones."""
        return self.address_taken | {"main"}


def _prog(functions: str, edges: str, *, o2: str | None = None, o2_replaces: str = "",
          address_taken: str = "", indirect: dict[str, int] | None = None,
          cycles: tuple[str, ...] = ()) -> Expected:
    e0 = _edges(edges)
    e2 = e0
    if o2 is not None:
        removed = _edges(o2_replaces)
        assert removed <= e0, removed - e0
        e2 = (e0 - removed) | _edges(o2)
    return Expected(frozenset(functions.split()), e0, e2, frozenset(address_taken.split()) | {"main"},
                    dict(indirect or {}), frozenset(frozenset(c.split()) for c in cycles))


EXPECTED: dict[str, Expected] = {
    "calls": _prog(
        "main helper twice say opener",
        """
        main -> puts 1 plt
        main -> twice 1 direct
        main -> helper 3 direct
        main -> opener 1 direct
        main -> say 2 direct
        twice -> helper 2 direct
        say -> strlen 1 plt
        say -> write 1 plt
        opener -> open 1 plt
        opener -> close 1 plt
        opener -> getppid 1 plt
        """),
    "recursion": _prog(
        "main report fact is_even is_odd ring_a ring_b ring_c",
        """
        main -> strtol 1 plt
        main -> fact 1 direct
        main -> is_even 1 direct
        main -> ring_a 1 direct
        main -> puts 1 plt
        main -> report 3 direct
        fact -> fact 1 direct
        fact -> getppid 1 plt
        is_even -> is_odd 1 direct
        is_odd -> is_even 1 direct
        is_even -> report 1 direct
        ring_a -> ring_b 1 direct
        ring_b -> ring_c 1 direct
        ring_c -> ring_a 1 direct
        ring_c -> open 1 plt
        ring_c -> close 1 plt
        report -> write 1 plt
        """,
        cycles=("fact", "is_even is_odd", "ring_a ring_b ring_c")),
    "tailcall": _prog(
        "main finish step chain tail_plt notail",
        """
        main -> chain 1 direct
        main -> tail_plt 1 direct
        main -> notail 1 direct
        main -> puts 2 plt
        main -> strtol 1 plt
        chain -> step 1 direct
        step -> finish 1 direct
        notail -> finish 1 direct
        finish -> getppid 1 plt
        finish -> write 1 plt
        tail_plt -> getppid 1 plt
        """,
        o2_replaces="""
        chain -> step 1 direct
        step -> finish 1 direct
        tail_plt -> getppid 1 plt
        """,
        o2="""
        chain -> step 1 tail
        step -> finish 1 tail
        tail_plt -> getppid 1 tail
        """),
    "fptr": _prog(
        "main op_add op_mul op_sys op_neg run_table cmp_int sort_it pick",
        """
        main -> puts 1 plt
        main -> run_table 1 direct
        main -> sort_it 1 direct
        main -> pick 1 direct
        main -> write 1 plt
        sort_it -> qsort 1 plt
        cmp_int -> getppid 1 plt
        op_sys -> getppid 1 plt
        """,
        address_taken="op_add op_mul op_sys op_neg cmp_int",
        indirect={"run_table": 1, "main": 1}),
    "switch": _prog(
        "main dispatch k0 k1 k2 k3 k4 k5 k6 k7",
        """
        main -> puts 1 plt
        main -> dispatch 1 direct
        main -> write 1 plt
        dispatch -> k0 1 direct
        dispatch -> k1 1 direct
        dispatch -> k2 1 direct
        dispatch -> k3 1 direct
        dispatch -> k4 1 direct
        dispatch -> k5 1 direct
        dispatch -> k6 1 direct
        dispatch -> k7 1 direct
        k5 -> getppid 1 plt
        """),
    "threads": _prog(
        "main down_a down_b worker_a worker_b",
        """
        main -> strtol 1 plt
        main -> puts 2 plt
        main -> fflush 1 plt
        main -> pthread_create 2 plt
        main -> pthread_join 2 plt
        worker_a -> down_a 1 direct
        down_a -> down_a 1 direct
        down_a -> getppid 1 plt
        worker_b -> down_b 1 direct
        down_b -> down_b 1 direct
        down_b -> write 1 plt
        """,
        address_taken="worker_a worker_b",
        cycles=("down_a", "down_b")),
    "longjmp": _prog(
        "main after dive guarded",
        """
        main -> strtol 1 plt
        main -> puts 1 plt
        main -> guarded 1 direct
        main -> after 1 direct
        guarded -> _setjmp 1 plt
        guarded -> dive 1 direct
        guarded -> after 1 direct
        dive -> dive 1 direct
        dive -> getppid 1 plt
        dive -> longjmp 1 plt
        after -> write 1 plt
        """,
        cycles=("dive",)),
    "exceptions": _prog(
        "main note descend catcher",
        """
        main -> strtol 1 plt
        main -> puts 1 plt
        main -> catcher 1 direct
        main -> note 1 direct
        catcher -> descend 1 direct
        catcher -> note 1 direct
        catcher -> __cxa_begin_catch 1 plt
        catcher -> __cxa_end_catch 2 plt
        catcher -> _Unwind_Resume 2 plt
        descend -> descend 1 direct
        descend -> getppid 1 plt
        descend -> __cxa_allocate_exception 1 plt
        descend -> __cxa_throw 1 plt
        note -> write 1 plt
        """,
        cycles=("descend",)),
    "sighandler": _prog(
        "main in_handler on_signal install trigger",
        """
        main -> puts 1 plt
        main -> fflush 1 plt
        main -> install 1 direct
        main -> trigger 1 direct
        main -> write 1 plt
        install -> sigemptyset 1 plt
        install -> sigaction 1 plt
        trigger -> raise 1 plt
        on_signal -> in_handler 1 direct
        on_signal -> write 1 plt
        in_handler -> getppid 1 plt
        """,
        address_taken="on_signal"),
    "forks": _prog(
        "main child_work parent_work spawn",
        """
        main -> puts 1 plt
        main -> fflush 1 plt
        main -> spawn 1 direct
        main -> write 1 plt
        spawn -> fork 1 plt
        spawn -> child_work 1 direct
        spawn -> parent_work 1 direct
        child_work -> getppid 1 plt
        child_work -> write 1 plt
        child_work -> _exit 1 plt
        parent_work -> waitpid 1 plt
        parent_work -> write 1 plt
        """),
    "execs": _prog(
        "main prepare run_exec",
        """
        main -> puts 1 plt
        main -> fflush 1 plt
        main -> prepare 1 direct
        main -> run_exec 1 direct
        prepare -> getppid 1 plt
        prepare -> write 1 plt
        run_exec -> execv 1 plt
        run_exec -> write 1 plt
        """),
    "vdso_loop": _prog(
        "main say spin_monotonic spin_tod cpu_clock_calls",
        """
        main -> atol 1 plt
        main -> say 2 direct
        main -> spin_monotonic 1 direct
        main -> spin_tod 1 direct
        main -> cpu_clock_calls 1 direct
        say -> strlen 1 plt
        say -> write 1 plt
        spin_monotonic -> clock_gettime 1 plt
        spin_tod -> gettimeofday 1 plt
        cpu_clock_calls -> clock_gettime 1 plt
        """,
        # <stdlib.h>'s inline atol calls strtol when optimising.
        o2_replaces="""
        main -> atol 1 plt
        """,
        o2="""
        main -> strtol 1 plt
        """),
    "spawns": _prog(
        "main worker make_thread fork_child make_fork make_spawn make_vfork",
        """
        main -> make_thread 1 direct
        main -> make_fork 1 direct
        main -> make_spawn 1 direct
        main -> make_vfork 1 direct
        main -> puts 1 plt
        main -> fflush 1 plt
        make_thread -> pthread_create 1 plt
        make_thread -> pthread_join 1 plt
        worker -> getppid 1 plt
        make_fork -> fork 1 plt
        make_fork -> fork_child 1 direct
        make_fork -> waitpid 1 plt
        fork_child -> getppid 1 plt
        fork_child -> _exit 1 plt
        make_spawn -> posix_spawn 1 plt
        make_spawn -> waitpid 1 plt
        make_vfork -> vfork 1 plt
        make_vfork -> _exit 1 plt
        make_vfork -> waitpid 1 plt
        """,
        address_taken="worker"),
    "forkburst": _prog(
        "main burst spawn child_work",
        """
        main -> burst 2 direct
        main -> spawn 1 direct
        main -> puts 1 plt
        main -> fflush 1 plt
        burst -> getppid 1 plt
        spawn -> fork 1 plt
        spawn -> child_work 1 direct
        spawn -> execl 1 plt
        spawn -> _exit 1 plt
        spawn -> waitpid 1 plt
        child_work -> close 3 plt
        """),
    "exithandlers": _prog(
        "main emit flush_chain handler_a handler_b fini_hook deeper work",
        """
        main -> atoi 1 plt
        main -> atexit 2 direct
        main -> work 1 direct
        emit -> strlen 1 plt
        emit -> write 1 plt
        flush_chain -> flush_chain 1 direct
        flush_chain -> emit 1 direct
        handler_a -> flush_chain 1 direct
        handler_b -> emit 1 direct
        fini_hook -> emit 1 direct
        deeper -> memset 1 plt
        deeper -> emit 1 direct
        work -> work 1 direct
        work -> deeper 1 direct
        """,
        # atexit is linked into the binary (libc_nonshared.a): a direct call.  At -O2 atoi becomes
        # strtol, the 64-byte memset becomes stores, and the calls in tail position become jumps.
        o2_replaces="""
        main -> atoi 1 plt
        flush_chain -> emit 1 direct
        deeper -> memset 1 plt
        work -> deeper 1 direct
        """,
        o2="""
        main -> strtol 1 plt
        flush_chain -> emit 1 tail
        work -> deeper 1 tail
        """,
        address_taken="handler_a handler_b fini_hook",
        cycles=("flush_chain", "work")),
}


def summarize(edges: list[tuple[str, str, str]]) -> frozenset[Edge]:
    """(caller, callee, kind) per call site -> the (caller, callee, sites, kind) form of EXPECTED."""
    return frozenset((c, d, n, k) for (c, d, k), n in Counter(edges).items())
