// gocalls: a Go program for tests/test_unwind_go.py.  Go binaries have no .eh_frame: their only CFI
// is .debug_frame, which the Go linker writes compressed (SHF_COMPRESSED, zlib).  The main
// goroutine is locked to the main thread, so its syscalls are one thread's, in program order:
//   getppid x3 through main.main > main.mid > main.leaf (recursing 3 times) > syscall.Getppid,
//   then getppid from a function value called through an interface method (indirect calls),
//   then, only with GOCALLS_EXTRA set in the environment, getppid from main.extra (a path the
//   anomaly test's model never learned), then one write of "gocalls: done\n".
package main

import (
	"os"
	"runtime"
	"syscall"
)

func init() { runtime.LockOSThread() }

//go:noinline
func leaf(n int) int {
	if n == 0 {
		return syscall.Getppid()
	}
	return leaf(n-1) + 1
}

//go:noinline
func mid() int { return leaf(3) }

//go:noinline
func extra() int { return syscall.Getppid() }

type caller interface{ call() int }

type viaFunc struct{ f func() int }

//go:noinline
func (v viaFunc) call() int { return v.f() }

func main() {
	total := 0
	for i := 0; i < 3; i++ {
		total += mid()
	}
	var c caller = viaFunc{f: func() int { return syscall.Getppid() }}
	total += c.call()
	if os.Getenv("GOCALLS_EXTRA") != "" {
		total += extra()
	}
	if total == 0 {
		os.Exit(3)
	}
	os.Stdout.Write([]byte("gocalls: done\n"))
}
