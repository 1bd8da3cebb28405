"""The unwinder's shared rule table (``uw_rules``) when it fills up: a module whose rules do not fit
is left without a table (its frames are flagged ``no_table``), and must not leave rule ids behind.
Before the fix, ids handed out to the first rules of a table that then did not fit were kept but
never written, so a later module using one of those rules pointed its rows at an all-zero slot and
the BPF unwinder would apply a rule nobody uploaded."""

from __future__ import annotations

from array import array

from ccprofd.elf import cfi
from ccprofd.elf.addrspace import AddressSpace
from ccprofd.tracing.unwind.sampler import UnwindSampler
from ccprofd.tracing.unwind.tables import RULE_STRUCT, LoadedModule, pack_rule


def _table(path: str, rules: list[cfi.Rule]) -> cfi.UnwindTable:
    starts = array("Q", [0x1000 + 0x10 * i for i in range(len(rules) + 1)])
    rule_ids = array("H", [*range(len(rules)), 0])
    return cfi.UnwindTable(None, path, starts, rule_ids, rules)


def _module(path: str) -> LoadedModule:
    return LoadedModule(-1, path, None, AddressSpace([]), None)


def test_a_table_that_does_not_fit_leaves_no_unuploaded_rule_ids() -> None:
    from conftest import require_bpf

    require_bpf()
    r1 = cfi.Rule(cfi.CFA_RSP, 8)
    r2 = cfi.Rule(cfi.CFA_RSP, 16)
    r3 = cfi.Rule(cfi.CFA_RBP, 16, cfi.RBP_AT_CFA, -16)
    with UnwindSampler(syscalls=[1], max_rules=2, max_depth=64) as s:
        too_big = _module("/too-big")
        s.tables.upload_table(too_big, _table("/too-big", [r1, r2, r3]))  # 3 rules, room for 2
        assert too_big.rows == 0  # not uploaded: its frames are flagged, not unwound wrongly
        fits = _module("/fits")
        s.tables.upload_table(fits, _table("/fits", [r2, r1]))
        assert fits.rows == 3
        rules = s.module.map("uw_rules")
        for rule in (r1, r2):
            rid = s.tables.rule_ids[rule]
            stored = bytes(rules.get(rid))[: RULE_STRUCT.size]
            assert stored == pack_rule(rule), (rule, rid, stored)
        # and the module's rows name exactly those ids, in its order
        entries = s.module.map("uw_entries")
        first = [entries.get(i) for i in range(2)]
        assert [int(e.rule) for e in first] == [s.tables.rule_ids[r2], s.tables.rule_ids[r1]]
