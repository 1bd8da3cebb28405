// ccprofd anomaly enforcement: deny (BPF LSM) or kill (bpf_send_signal fallback) an open, exec or
// connect made from a calling context that is not in the allowed set.
//
// Placed as a prelude before syscall_sampler.c (which tracks the process through fork and exec).
//
// The context key: uprobes on the target's calls into the PLT record, per thread, a 64-bit hash of
// the context at that call -- the call site (file offset) followed by the return addresses of the
// frame-pointer chain that lie in the target binary (file offsets from bpf_get_stack's build-id
// mode), innermost first -- together with the user sp at the call and the return address the call
// pushes.  At the hook, the record is used only if that return address is still in the word below
// the recorded sp (the library call is still on the stack); otherwise the key is KEY_NONE (no
// context in the binary: the dynamic loader, exit handlers).  Userspace computes the same hash
// from the model's decoded frames (see enforce.py), so the allowed set is the model.
//
// Knobs (defines): MAX_STACK (frames walked), CCPROF_ENFORCE_LSM (attach LSM hooks that return
// -EPERM; else the sys_enter hook kills with SIGKILL before the syscall returns to user space).
#include <asm/ptrace.h>
#include <linux/errno.h>

#ifndef MAX_STACK
#define MAX_STACK 64
#endif
#define HOOK_FILE_OPEN 1
#define HOOK_EXEC 2
#define HOOK_CONNECT 3
struct file;
struct linux_binprm;
struct socket;
struct sockaddr;

#define KEY_SEED 0xcbf29ce484222325ULL
#define KEY_PRIME 0x100000001b3ULL
#define KEY_NONE KEY_SEED
#define BUILD_ID_SIZE 20
#define STACK_BUILD_ID_VALID 1
#define SIGKILL 9

#define VERDICT_ALLOWED 1
#define VERDICT_DENIED 2
#define VERDICT_KILLED 3

#define ESTAT_SITE_HITS 0
#define ESTAT_STALE 1
#define ESTAT_DENIED 2
#define ESTAT_CHECKED 3
#define NR_ESTATS 8

struct enf_frame {
    s32 status;
    unsigned char build_id[BUILD_ID_SIZE];
    u64 offset;
};

struct enf_stack {
    struct enf_frame f[MAX_STACK];
};

struct enf_pending {
    u64 key;
    u64 sp;   // user sp at the call instruction (before the push)
    u64 ret;  // runtime return address the call pushes at sp - 8
};

struct enf_allowed_key {
    u32 hook;
    u32 pad;
    u64 key;
};

struct enf_target {
    unsigned char build_id[BUILD_ID_SIZE];
};

BPF_ARRAY(enf_target, struct enf_target, 1);
BPF_PERCPU_ARRAY(enf_scratch, struct enf_stack, 1);
BPF_HASH(enf_pending, u32, struct enf_pending, 65536);
BPF_HASH(enf_allowed, struct enf_allowed_key, u8, 262144);
BPF_PERCPU_ARRAY(enf_stats, u64, NR_ESTATS);
BPF_ARRAY(enf_config, u64, 4);  // [0]: 1 = enforce (deny/kill), 0 = audit only

// Processes under enforcement: 1 = armed (the launcher, until its exec of the target), 2 = active.
BPF_HASH(enf_procs, u32, u32, 4096);
#define ENF_ARMED 1
#define ENF_ACTIVE 2

struct enf_verdict {
    u32 hook;
    u32 verdict;
};
BPF_HASH(enf_verdicts, u32, struct enf_verdict, 65536);

static __always_inline void enf_stat(u32 idx) {
    u64 *v = enf_stats.lookup(&idx);
    if (v)
        __sync_fetch_and_add(v, 1);
}

static __always_inline u64 enf_mix(u64 h, u64 v) {
    return (h ^ v) * KEY_PRIME;
}

static __always_inline int enf_same_build(const unsigned char *a, const unsigned char *b) {
#pragma unroll
    for (int i = 0; i < BUILD_ID_SIZE; i++)
        if (a[i] != b[i])
            return 0;
    return 1;
}

// uprobe_multi on every call into the PLT of the target.  Cookie: call-site file offset in the low
// 48 bits, instruction length above.
int enf_site(struct pt_regs *ctx) {
    u32 zero = 0;
    u64 cookie = bpf_get_attach_cookie(ctx);
    struct enf_target *t = enf_target.lookup(&zero);
    struct enf_stack *st = enf_scratch.lookup(&zero);
    if (!t || !st)
        return 0;
    enf_stat(ESTAT_SITE_HITS);
    u64 site = cookie & 0xffffffffffffULL;
    u64 len = cookie >> 48;
    long n = bpf_get_stack(ctx, st, sizeof(*st), BPF_F_USER_STACK | BPF_F_USER_BUILD_ID);
    u64 h = enf_mix(KEY_SEED, site);
    if (n > 0) {
        long frames = n / (long)sizeof(struct enf_frame);
        // Entry 0 is the call site itself (hashed from the cookie); then the innermost contiguous
        // run of frames in the target binary.
        for (int i = 1; i < MAX_STACK; i++) {
            if (i >= frames)
                break;
            struct enf_frame *f = &st->f[i];
            if (f->status != STACK_BUILD_ID_VALID || !enf_same_build(f->build_id, t->build_id))
                break;
            h = enf_mix(h, f->offset);
        }
    }
    struct enf_pending p = {};
    p.key = h;
    p.sp = PT_REGS_SP(ctx);
    p.ret = PT_REGS_IP(ctx) + len;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    enf_pending.update(&tid, &p);
    return 0;
}

// The current thread's context key at a hook, given the user sp there.
static __always_inline u64 enf_current_key(u64 user_sp) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct enf_pending *p = enf_pending.lookup(&tid);
    if (!p)
        return KEY_NONE;
    u64 word = 0;
    if (user_sp > p->sp - 8 || bpf_probe_read_user(&word, sizeof(word), (void *)(p->sp - 8)) != 0 ||
        word != p->ret) {
        enf_stat(ESTAT_STALE);
        return KEY_NONE;
    }
    return p->key;
}

// 1 = allowed.
static __always_inline int enf_allowed_now(u32 hook, u64 key) {
    struct enf_allowed_key k = {};
    k.hook = hook;
    k.key = key;
    enf_stat(ESTAT_CHECKED);
    return enf_allowed.lookup(&k) != 0;
}

static __always_inline int enf_enforcing(void) {
    u32 zero = 0;
    u64 *on = enf_config.lookup(&zero);
    return on && *on;
}

static __always_inline u32 enf_hook_of(long nr) {
    switch (nr) {
    case 2:    // open
    case 85:   // creat
    case 257:  // openat
    case 437:  // openat2
        return HOOK_FILE_OPEN;
    case 59:   // execve
    case 322:  // execveat
        return HOOK_EXEC;
    case 42:   // connect
        return HOOK_CONNECT;
    }
    return 0;
}

// Fills the sampler's event extra fields at each reported syscall of a tracked process.  Without
// BPF LSM, this is where enforcement happens: a SIGKILL queued at syscall entry is delivered before
// the syscall returns to user space, so the program never runs past it (the syscall itself may
// complete: an open creates its file descriptor, an exec may already have replaced the image).
static __always_inline void enf_syscall_hook(struct pt_regs *regs, long nr, u64 *key_out, u32 *hook_out,
                                             u32 *verdict_out) {
    u32 hook = enf_hook_of(nr);
    *hook_out = hook;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u32 *state = enf_procs.lookup(&tgid);
    if (!hook || !state || *state != ENF_ACTIVE)
        return;
#ifdef CCPROF_ENFORCE_LSM
    u32 self = (u32)bpf_get_current_pid_tgid();
    enf_verdicts.delete(&self);  // no stale verdict survives into this syscall
#endif
    u64 sp = 0;
    bpf_probe_read_kernel(&sp, sizeof(sp), &regs->sp);
    u64 key = enf_current_key(sp);
    *key_out = key;
    if (enf_allowed_now(hook, key)) {
        *verdict_out = VERDICT_ALLOWED;
        return;
    }
    enf_stat(ESTAT_DENIED);
#ifdef CCPROF_ENFORCE_LSM
    *verdict_out = VERDICT_DENIED;  // the LSM hook the syscall reaches returns -EPERM
    struct enf_verdict v = {};
    v.hook = hook;
    v.verdict = VERDICT_DENIED;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    enf_verdicts.update(&tid, &v);
#else
    if (enf_enforcing()) {
        bpf_send_signal(SIGKILL);
        *verdict_out = VERDICT_KILLED;
    } else {
        *verdict_out = VERDICT_DENIED;
    }
#endif
}

// Exec: an armed launcher becomes the target (active); an active process that execs another image
// leaves enforcement (the model is for the target binary only).
static __always_inline void enf_exec_do(void *args) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u32 *state = enf_procs.lookup(&tgid);
    if (!state)
        return;
    if (*state == ENF_ARMED) {
        u32 active = ENF_ACTIVE;
        enf_procs.update(&tgid, &active);
    } else {
        enf_procs.delete(&tgid);
    }
}

int enf_exec(void *args) {
    enf_exec_do(args);
    return 1;  // the event goes on to perf's own listeners (kbpf/attach.py)
}

// Fork: children of an active process stay under enforcement (same image, same contexts).
// (Plain context pointer: the sampler's programs already declare the tracepoint structs; the child
// pid's offset comes from the tracepoint's format file as FORK_CHILD_PID_OFFSET.)
static __always_inline void enf_fork_do(void *args) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u32 *state = enf_procs.lookup(&tgid);
    if (!state || *state != ENF_ACTIVE)
        return;
    s32 child_pid = 0;
    bpf_probe_read_kernel(&child_pid, sizeof(child_pid), (char *)args + FORK_CHILD_PID_OFFSET);
    u32 child = (u32)child_pid;
    u32 active = ENF_ACTIVE;
    enf_procs.update(&child, &active);
}

int enf_fork(void *args) {
    enf_fork_do(args);
    return 1;  // the event goes on to perf's own listeners (kbpf/attach.py)
}

int enf_exit(void *args) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    if ((u32)pid_tgid == (u32)(pid_tgid >> 32)) {
        u32 tgid = pid_tgid >> 32;
        enf_procs.delete(&tgid);
    }
    u32 tid = (u32)pid_tgid;
    enf_pending.delete(&tid);
    return 1;  // the event goes on to perf's own listeners (kbpf/attach.py)
}

#define CCPROF_EVENT_EXTRA u64 enf_key; u32 enf_hook; u32 enf_verdict;
#define CCPROF_SYSCALL_HOOK(ctx, regs, e) enf_syscall_hook(regs, (long)(e)->nr, &(e)->enf_key, \
                                                            &(e)->enf_hook, &(e)->enf_verdict)

#ifdef CCPROF_ENFORCE_LSM
// The verdict of the current syscall, decided at sys_enter (above) and applied by the LSM hook the
// syscall reaches; an exec's verdict serves both the open of the binary and bprm_check_security.
static __always_inline int enf_lsm_apply(u32 hook) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct enf_verdict *v = enf_verdicts.lookup(&tid);
    if (!v)
        return 0;
    int deny = v->verdict == VERDICT_DENIED && enf_enforcing();
    if (v->hook == hook)
        enf_verdicts.delete(&tid);
    return deny ? -EPERM : 0;
}

LSM_PROBE(file_open, struct file *file) {
    return enf_lsm_apply(HOOK_FILE_OPEN);
}

LSM_PROBE(bprm_check_security, struct linux_binprm *bprm) {
    return enf_lsm_apply(HOOK_EXEC);
}

LSM_PROBE(socket_connect, struct socket *sock, struct sockaddr *address, int addrlen) {
    return enf_lsm_apply(HOOK_CONNECT);
}
#endif
