// Exec targets: binaries, by inode number, whose new processes are tracked from their exec (the
// daemon's `path` targets).  sched_process_exec runs in the new image before its first user
// instruction, so a process tracked there loses none of its syscalls.
//
// The inode is read through task->mm->exe_file->f_inode->i_ino (what /proc/PID/exe names), with
// member offsets taken from the running kernel's BTF (kbpf/btf.py: the compile-time headers may be
// from another kernel) and bpf_probe_read_kernel, so a wrong offset yields a wrong number, never a
// fault; userspace confirms every match against /proc/PID/exe before it trusts it.  Without the
// offsets (CCPROF_OFF_TASK_MM undefined) nothing matches and the caller falls back to rescans.
// The exec's filename is not used: it may be relative or a symlink.
#ifndef CCPROF_EXEC_TARGET_C
#define CCPROF_EXEC_TARGET_C

#ifndef MAX_EXEC_TARGETS
#define MAX_EXEC_TARGETS 64
#endif

// inode number -> cgroup id the process must be in (0: any)
BPF_HASH(exec_targets, u64, u64, MAX_EXEC_TARGETS);

static __always_inline u64 ccprof_current_exe_ino(void) {
#ifdef CCPROF_OFF_TASK_MM
    char *task = (char *)bpf_get_current_task();
    char *mm = 0, *file = 0, *inode = 0;
    u64 ino = 0;
    if (bpf_probe_read_kernel(&mm, sizeof(mm), task + CCPROF_OFF_TASK_MM) != 0 || !mm)
        return 0;
    if (bpf_probe_read_kernel(&file, sizeof(file), mm + CCPROF_OFF_MM_EXE_FILE) != 0 || !file)
        return 0;
    if (bpf_probe_read_kernel(&inode, sizeof(inode), file + CCPROF_OFF_FILE_INODE) != 0 || !inode)
        return 0;
    if (bpf_probe_read_kernel(&ino, sizeof(ino), inode + CCPROF_OFF_INODE_INO) != 0)
        return 0;
    return ino;
#else
    return 0;
#endif
}

// Whether the current process (just after an exec) runs an exec target.
static __always_inline int ccprof_exec_is_target(void) {
    u64 ino = ccprof_current_exe_ino();
    if (!ino)
        return 0;
    u64 *cgroup = exec_targets.lookup(&ino);
    if (!cgroup)
        return 0;
    return *cgroup == 0 || *cgroup == bpf_get_current_cgroup_id();
}

#endif
