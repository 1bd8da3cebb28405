/* Shared helpers for the ccprofd test programs.
 *
 * NOINLINE keeps every function a function of its own at -O2 (no inlining, no IPA cloning such as
 * .isra/.constprop/.part, no IPA-based assumptions), so the call graph written by hand next to each
 * program holds at -O0 and -O2 alike.  `sink` is a volatile store: placed after a call, it keeps the
 * call from becoming a tail call (jmp) at -O2; placed before, it keeps a function from being empty.
 */
#ifndef CCPROFD_SHAPES_H
#define CCPROFD_SHAPES_H

#define NOINLINE __attribute__((noinline, noipa))

extern volatile long sink;

#endif
