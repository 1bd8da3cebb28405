// ccprofd --save-edge-weights: one hit counter per direct call / tail-jump site of the target binary
// (the uprobe_multi attach cookie is the site's index), counted only in the traced processes
// (the launched or attached process and every process forked from it).
// Knobs: NSITES, MAX_TRACKED.
#include <asm/ptrace.h>

BPF_HASH(cnt_tracked, u32, u8, MAX_TRACKED);
BPF_ARRAY(cnt_hits, u64, NSITES);

int cnt_site(struct pt_regs *ctx) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!cnt_tracked.lookup(&tgid))
        return 0;
    u32 i = (u32)bpf_get_attach_cookie(ctx);
    u64 *v = cnt_hits.lookup(&i);
    if (v)
        __sync_fetch_and_add(v, 1);
    return 0;
}

static __always_inline void cnt_fork_do(u32 child) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!cnt_tracked.lookup(&tgid))
        return;
    u8 one = 1;
    cnt_tracked.update(&child, &one);
}

int cnt_fork(struct tracepoint__sched__sched_process_fork *args) {
    cnt_fork_do((u32)args->child_pid);  // (bcc defines the struct for this function only)
    return 1;  // the event goes on to perf's own listeners (kbpf/attach.py)
}
