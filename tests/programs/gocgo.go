// gocgo: a cgo program for tests/test_unwind_go.py: main calls a C function (through cgo's
// runtime.cgocall > asmcgocall, which runs it on the thread's g0 stack) that makes getppid.
package main

/*
#include <unistd.h>
static int __attribute__((noinline)) c_parent(void) { return (int)getppid(); }
*/
import "C"

import "os"

//go:noinline
func parent() int { return int(C.c_parent()) }

func main() {
	if parent() == 0 {
		os.Exit(3)
	}
	os.Stdout.Write([]byte("gocgo: done\n"))
}
